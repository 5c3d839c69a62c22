"""Benchmark (not a test): DualPipeV against interleaved 1F1B (VPP 2), both with the EP overlap, matched.

    python scripts/performance/bench_pipeline_schedules.py --pipeline_model_parallel_size 2 --num_layers 4 \
        --nproc_per_node 4 -ms 12

The harness's recipe and flags (``ep_overlap_ab.py``'s) as a Megatron-Core ``GPTModel`` on PP P x EP E: both
schedules' arms in the same ranks, step by step in ABBA order, same seed and data (``utils/arms.py``). Per steady step
the ratio T_interleaved / T_dualpipev (the slowest rank's step), its median with a 95% bootstrap interval, and each
schedule's median step. Beside it the planner's price of both schedules (``ep_overlap_lab/planner/dualpipev.py``) for
per-layer unit costs F = 1, B = 2 and W = 0 (the runtime defers no weight gradient), with F&B from F + B (the overlap
hides nothing) down to B (it hides the whole forward).

CPU only: Megatron-Core's MoE layer calls CUDA streams directly, so each rank installs the tests' CPU stand-ins
(``tests/unit_tests/training/ep_overlap/mcore_cpu.py``), as the tests do; gloo throughout.
"""

import copy
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from argument_parser import parse_cli_args  # noqa: E402
from utils.quiet import quiet_third_party_imports  # noqa: E402

SCHEDULES = ("interleaved", "dualpipev")


def _rank(rank: int, world: int, specs: list) -> dict:
    sys.path.insert(0, str(ROOT))
    from utils.arms import run_arms

    from tests.unit_tests.training.ep_overlap.mcore_cpu import init_megatron, install_cpu_stubs

    install_cpu_stubs()
    m = specs[0].model
    init_megatron(m.expert_model_parallel_size, m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size)
    return run_arms(rank, world, specs)


def planned(layers: int, P: int, N: int) -> list[str]:
    """The planner's step of both schedules and their ratio, for unit costs (see the module docstring)."""
    from ep_overlap_lab.planner.dualpipev import LayerCosts, price

    lines = []
    for paired, what in ((3.0, "F&B = F + B, nothing hidden"), (2.0, "F&B = B, the forward hidden")):
        costs = LayerCosts(forward_s=1.0, backward_s=2.0, weight_s=0.0, paired_s=paired)
        steps = {s: price(s, layers, P, N, costs, virtual_size=2) for s in SCHEDULES}
        lines.append(
            f"  planner ({what}): interleaved {steps['interleaved'].step_s:g}, dualpipev {steps['dualpipev'].step_s:g}"
            f" units (bubble {steps['interleaved'].bubble_s:g} vs {steps['dualpipev'].bubble_s:g}, layers held "
            f"{steps['interleaved'].held_layers} vs {steps['dualpipev'].held_layers}); ratio "
            f"{steps['interleaved'].step_s / steps['dualpipev'].step_s:.3f}x"
        )
    return lines


def main(argv: list[str]) -> int:
    fixed = ["--model_impl", "mcore", "--dist_backend", "gloo", "--pipeline_schedule", "dualpipev"]
    args = parse_cli_args([*fixed, "--moe_a2a_overlap", "true", *argv])
    with quiet_third_party_imports():
        from utils.arms import ArmSpec
        from utils.harness_config import ConfigError, arms_of, build_recipe
        from utils.stats import format_ci, median_ci, step_series

        from ep_overlap_lab.multiprocess import run_local_ranks
    try:
        recipe = build_recipe(args)  # DualPipeV's checks; its two stages per rank are VPP 2, as interleaved runs
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    (arm,) = arms_of(recipe, args)
    specs = [
        ArmSpec(s, copy.copy(arm["model"]), arm["options"], recipe.train, "cpu", progress=False,
                model_impl="mcore", pipeline_schedule=s)
        for s in SCHEDULES
    ]  # fmt: skip
    m, t = recipe.model, recipe.train
    load = os.getloadavg()
    print(f"running interleaved and dualpipev (overlap on) on {args.nproc_per_node} CPU ranks ...", flush=True)
    outcomes = run_local_ranks(_rank, args.nproc_per_node, (specs,), collective_timeout_s=t.collective_timeout_s)
    after = os.getloadavg()
    results = {s: [o.result[s] for o in outcomes] for s in SCHEDULES}
    steps = {s: step_series(results[s], "step_times_s")[t.warmup_steps :] for s in SCHEDULES}
    ratio = median_ci([i / d for i, d in zip(steps["interleaved"], steps["dualpipev"])])
    P = m.pipeline_model_parallel_size
    print(
        f"PP {P} x EP {m.expert_model_parallel_size}, {m.num_layers} layers, {t.num_microbatches} microbatches x "
        f"{t.micro_batch_size * m.seq_length} tokens, hidden {m.hidden_size}, {os.cpu_count()} cores, load average "
        f"{load[0]:.1f} before, {after[0]:.1f} after; {len(steps['dualpipev'])} steady steps per arm"
    )
    for s in SCHEDULES:
        print(f"  {s:12} median step {format_ci(median_ci(steps[s]), '{:.3f} s', label='95% CI ')}")
    print(f"  T_interleaved / T_dualpipev (matched per step): {format_ci(ratio, '{:.3f}x', label='95% CI ')}")
    for line in planned(m.num_layers, P, t.num_microbatches):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
