"""MoE EP-overlap performance harness: one arm, or a matched A/B (overlap off vs on) in one invocation.

    python scripts/performance/ep_overlap_ab.py --ab --link_gbps 1 --json out/ab.json --timeline out/timeline.png

Under torchrun it uses the launcher's environment (multi-node works as torchrun does). Started plainly it
spawns ``--nproc_per_node`` local ranks: gloo on CPU, NCCL on GPU. With ``--link_gbps`` (root) each local rank
gets its own network namespace behind a link shaped to that rate, so all-to-all is wire-bound as between nodes.

Bad flags and overrides are refused before any rank starts, one line per problem, with exit status 2. This
file parses the command line only; torch and Megatron are imported once the arguments are known to be usable,
so ``--help`` answers at once.
"""

import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from argument_parser import parse_cli_args  # noqa: E402
from utils.quiet import quiet_third_party_imports  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = parse_cli_args(argv)
    from utils.stopping import STOPPING, signal_handlers, stopped_by

    try:  # the signals stop the run from here on, the imports below included
        with signal_handlers(STOPPING), quiet_third_party_imports(enabled=not args.verbose):
            from utils.ab_run import run
    except (KeyboardInterrupt, SystemExit) as exc:
        code, name = stopped_by(exc)
        print(f"stopped by {name} while starting up; no rank had started", file=sys.stderr)
        return code
    return run(args)


if __name__ == "__main__":
    status = main()
    # The run is over: a signal while the interpreter shuts down must not replace its exit status.
    from utils.stopping import IGNORED

    for signum, handler in IGNORED.items():
        signal.signal(signum, handler)
    sys.exit(status)
