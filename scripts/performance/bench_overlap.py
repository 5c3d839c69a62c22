"""Benchmark (not a test): sweep the emulated link speed so comm goes from well over to well under compute.

For each link speed it runs the harness's matched A/B (8 microbatches, arms interleaved ABBA in the same ranks)
with ``--predict`` and prints T_compute and T_comm (from the baseline arm, whose all-to-alls are all exposed), both
step times, the overlap step the planner predicts from the baseline's records, the speedup, and the hidden fraction

    h = (T_baseline - T_overlap) / min(T_compute, T_comm)

next to the bound 1F1B pairing allows: the first forward and the last backward are unpaired, so at most
(N - 1) / N of the hideable time can be hidden. Every measured figure is a median with its 95% interval. Then the
exposed comm per phase, predicted vs measured. Needs root (network namespaces). ``--out`` writes Markdown tables.
"""

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from argument_parser import parse_cli_args  # noqa: E402
from utils.quiet import quiet_third_party_imports  # noqa: E402

with quiet_third_party_imports():
    from utils.ab_summary import summarize
    from utils.harness_config import arms_of, build_recipe
    from utils.launch import Progress, run_local, specs_for
from utils.stats import format_ci, median_ci, step_series  # noqa: E402


def measure(link_gbps: float, steps: int, microbatches: int, extra: list[str]) -> dict:
    args = parse_cli_args(
        ["--ab", "--predict", "--device", "cpu", "-ms", str(steps), "--num_microbatches", str(microbatches)]
        + ["--link_gbps", str(link_gbps), *extra]
    )
    recipe = build_recipe(args)
    specs = specs_for(arms_of(recipe, args), recipe, "cpu")
    results = run_local(specs, args, "cpu", Progress(echo=False))
    summary = summarize(results, recipe, args, "cpu", args.nproc_per_node)
    warmup = recipe.train.warmup_steps
    base, over = summary["arms"]["baseline"], summary["arms"]["overlap"]
    t_base, t_comm = base["median_step_time_s"], base["comm_s"]
    prediction = summary["prediction"]
    return {
        "link_gbps": link_gbps,
        "t_compute": t_base - t_comm,
        "t_comm": t_comm,
        "ratio": t_comm / (t_base - t_comm),
        "t_baseline": median_ci(step_series(results["baseline"], "step_times_s")[warmup:]),
        "t_overlap": median_ci(step_series(results["overlap"], "step_times_s")[warmup:]),
        "speedup": summary["speedup"],
        "h": summary["h"],
        "bound": summary["bound"],
        "predicted": prediction,
        "numerics": summary["numerics"],
        "overlap_median_s": over["median_step_time_s"],
    }


HEADER = (
    "| link (Gbit/s) | T_comm/T_compute | baseline step (s) | overlap step (s), measured [95% CI] | predicted "
    "| error | speedup [95% CI] | h measured [95% CI] | h predicted | bound | bitwise equal |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def row(p: dict) -> str:
    predicted = p["predicted"]["overlap_step_s"]
    error = 100 * (predicted / p["t_overlap"]["median"] - 1)
    return (
        f"| {p['link_gbps']:g} | {p['ratio']:.2f} | {p['t_baseline']['median']:.2f} "
        f"| {format_ci(p['t_overlap'], '{:.2f}')} "
        f"| {predicted:.2f} | {error:+.1f}% | {format_ci(p['speedup'], '{:.3f}x')} | {format_ci(p['h'], '{:.2f}')} "
        f"| {p['predicted']['h']:.2f} | {p['bound']:.3f} | {_numerics(p['numerics'])} |"
    )


def _numerics(numerics: dict) -> str:
    if numerics["bitwise_equal"]:
        return "yes"
    if numerics["expected_bitwise"]:
        return "NO"
    return f"no (chunked; losses within {numerics['max_loss_rel_diff']:.0e} relative)"


PHASE_HEADER = "| link (Gbit/s) | phase | exposed comm predicted (s) | measured (s) |\n|---|---|---|---|"


def phase_rows(p: dict) -> list[str]:
    return [
        f"| {p['link_gbps']:g} | {phase} | {v['predicted']:.3f} | {v['measured']:.3f} |"
        for phase, v in p["predicted"]["exposed_comm_s_by_phase"].items()
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--links", type=float, nargs="+", default=[0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--delay_wgrad_compute", action="store_true", help="overlap arm also delays expert wgrad")
    parser.add_argument(
        "--attention_wgrad_window", choices=["1", "2", "auto"], default=None, help="with --delay_wgrad_compute (1)"
    )
    parser.add_argument("--edge_pairing", action="store_true", help="pair the warm-up's and cool-down's microbatches")
    parser.add_argument(
        "--moe_ep_overlap_chunks", choices=["1", "2"], default="1", help="2: chunked unpaired phases (not bitwise)"
    )
    parser.add_argument("--micro_batch_size", type=int, default=None, help="sequences per microbatch (recipe's: 1)")
    parser.add_argument("--seq_length", type=int, default=None, help="tokens per sequence (recipe's: 512)")
    parser.add_argument("--out", default=None, help="append the table to this Markdown file")
    args = parser.parse_args()
    extra = ["--delay_wgrad_compute", "true"] if args.delay_wgrad_compute else []
    if args.attention_wgrad_window is not None:  # the harness refuses it without delayed wgrad
        extra += ["--attention_wgrad_window", args.attention_wgrad_window]
    extra += ["--edge_pairing", "true" if args.edge_pairing else "false"]
    extra += ["--moe_ep_overlap_chunks", args.moe_ep_overlap_chunks]
    for flag in ("micro_batch_size", "seq_length"):
        if getattr(args, flag) is not None:
            extra += [f"--{flag}", str(getattr(args, flag))]
    title = (
        f"overlap arm: EP overlap{' + delayed wgrad' if args.delay_wgrad_compute else ''}; "
        f"{args.microbatches} microbatches, {args.steps} matched steps per arm, ABBA (first excluded), 2 ranks, "
        f"{os.cpu_count()} cores, {platform.machine()}, {datetime.date.today()}"
    )
    print(title)
    print(HEADER)
    rows, phases = [], []
    for link in args.links:
        point = measure(link, args.steps, args.microbatches, extra)
        rows.append(row(point))
        phases += phase_rows(point)
        print(rows[-1], flush=True)
    print(PHASE_HEADER)
    print("\n".join(phases))
    if args.out:
        with open(args.out, "a") as f:
            command = "python scripts/performance/bench_overlap.py " + " ".join(sys.argv[1:])
            f.write(
                f"\n### {title}\n\n`{command}`\n\n{HEADER}\n" + "\n".join(rows) + "\n\n"
                f"Exposed comm per phase of the overlap arm, predicted vs measured:\n\n{PHASE_HEADER}\n"
                + "\n".join(phases)
                + "\n"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
