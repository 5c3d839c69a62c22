"""Communication beside compute, from a profile: the seed page's matched-profile check, for any run's trace.

    python scripts/performance/overlap_from_trace.py TRACE              # a torch-profiler trace or nsys SQLite
    python scripts/performance/overlap_from_trace.py BASELINE OVERLAP   # two traces side by side, B - A
    python scripts/performance/overlap_from_trace.py TRACE --comm 'my_a2a_kernel'   # more communication names

Per step it prints the union of communication intervals and of compute intervals, their intersection, the
exposed communication and the concurrent fraction, then the same inside each range (NVTX, or the host's
annotations). It needs no torch (utils/trace_overlap.py). A file it cannot use gets one line and exit 2.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from utils.trace_overlap import STEP_PATTERN, TraceError, analyze, compare, read_trace, report  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", metavar="TRACE", help="one trace, or two (A then B) to compare")
    parser.add_argument("--comm", action="append", default=[], help="a regex naming more communication activities")
    parser.add_argument("--step", default=STEP_PATTERN, help=f"regex of a step's range name (default {STEP_PATTERN})")
    args = parser.parse_args(argv)
    if len(args.traces) > 2:
        print(f"error: {len(args.traces)} traces: give one, or two to compare", file=sys.stderr)
        return 2
    results = []
    try:
        for path in args.traces:
            trace = read_trace(path)
            results.append((trace, analyze(trace, args.comm, args.step)))
    except TraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for trace, steps in results:
        print("\n".join(report(trace, steps)))
    if len(results) == 2:
        print("\n".join(compare(results[0][1], results[1][1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
