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


def _stop_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_cli_args(argv)
    # Both signals stop the run from here on, also during the imports below, and whatever the launcher left them
    # as (a shell's background job inherits SIGINT ignored).
    previous = {
        signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
        signal.SIGTERM: signal.signal(signal.SIGTERM, _stop_on_sigterm),
    }
    try:
        with quiet_third_party_imports(enabled=not args.verbose):
            from utils.ab_run import run
    except (KeyboardInterrupt, SystemExit) as exc:
        code = 130 if isinstance(exc, KeyboardInterrupt) else int(exc.code or 1)
        name = signal.Signals(code - 128).name if code > 128 else "an interrupt"
        print(f"stopped by {name} while starting up; no rank had started", file=sys.stderr)
        return code
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
