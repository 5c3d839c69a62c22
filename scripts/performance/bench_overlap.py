"""Benchmark (not a test): sweep the emulated link speed so comm goes from well over to well under compute.

For each link speed it runs the harness's matched A/B (8 microbatches) and prints T_compute and T_comm (from
the baseline arm, whose all-to-alls are all exposed), both step times, the speedup, and the hidden fraction

    h = (T_baseline - T_overlap) / min(T_compute, T_comm)

next to the bound 1F1B pairing allows: the first forward and the last backward are unpaired, so at most
(N - 1) / N of the hideable time can be hidden. Needs root (network namespaces). ``--out`` writes a Markdown table.
"""

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from argument_parser import parse_cli_args  # noqa: E402
from utils.ab_run import build_recipe, plan_arms, run_local, specs_for, summarize  # noqa: E402


def measure(link_gbps: float, steps: int, microbatches: int, extra: list[str]) -> dict:
    args = parse_cli_args(
        ["--ab", "--device", "cpu", "-ms", str(steps), "--num_microbatches", str(microbatches)]
        + ["--link_gbps", str(link_gbps), *extra]
    )
    recipe = build_recipe(args)
    specs = specs_for(plan_arms(recipe, True), recipe, "cpu")
    for spec in specs:
        spec.progress = False
    summary = summarize(run_local(specs, args, "cpu"), recipe, args, "cpu", args.nproc_per_node)
    base, over = summary["arms"]["baseline"], summary["arms"]["overlap"]
    t_base, t_over, t_comm = base["median_step_time_s"], over["median_step_time_s"], base["comm_s"]
    t_compute = t_base - t_comm
    return {
        "link_gbps": link_gbps,
        "t_compute": t_compute,
        "t_comm": t_comm,
        "t_baseline": t_base,
        "t_overlap": t_over,
        "speedup": t_base / t_over,
        "h": (t_base - t_over) / min(t_compute, t_comm),
        "bound": (microbatches - 1) / microbatches,
        "ratio": t_comm / t_compute,
        "bitwise_equal": summary["numerics"]["bitwise_equal"],
    }


HEADER = (
    "| link (Gbit/s) | T_compute (s) | T_comm (s) | T_comm/T_compute | baseline step (s) | overlap step (s) "
    "| speedup | h | bound | bitwise equal |\n|---|---|---|---|---|---|---|---|---|---|"
)


def row(p: dict) -> str:
    return (
        f"| {p['link_gbps']:g} | {p['t_compute']:.2f} | {p['t_comm']:.2f} | {p['ratio']:.2f} | {p['t_baseline']:.2f} "
        f"| {p['t_overlap']:.2f} | {p['speedup']:.3f}x | {p['h']:.2f} | {p['bound']:.3f} | "
        f"{'yes' if p['bitwise_equal'] else 'NO'} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--links", type=float, nargs="+", default=[0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--delay_wgrad_compute", action="store_true", help="overlap arm also delays expert wgrad")
    parser.add_argument("--out", default=None, help="append the table to this Markdown file")
    args = parser.parse_args()
    extra = ["--delay_wgrad_compute", "true"] if args.delay_wgrad_compute else []
    title = (
        f"overlap arm: EP overlap{' + delayed wgrad' if args.delay_wgrad_compute else ''}; "
        f"{args.microbatches} microbatches, {args.steps} steps (first excluded), 2 ranks, "
        f"{os.cpu_count()} cores, {platform.machine()}, {datetime.date.today()}"
    )
    print(title)
    print(HEADER)
    rows = []
    for link in args.links:
        point = measure(link, args.steps, args.microbatches, extra)
        rows.append(row(point))
        print(rows[-1], flush=True)
    if args.out:
        with open(args.out, "a") as f:
            command = "python scripts/performance/bench_overlap.py " + " ".join(sys.argv[1:])
            f.write(f"\n### {title}\n\n`{command}`\n\n{HEADER}\n" + "\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
