"""EP-overlap planner: will overlap pay, with how many microbatches, with delayed wgrad or not? Before the run.

    # from a measured step (the harness's JSON; the baseline arm's records are the costs)
    python scripts/performance/ep_overlap_plan.py --from_json out/ab.json
    # from a published shape on a named cluster
    python scripts/performance/ep_overlap_plan.py --model qwen3-30b-a3b --gpus 16 --ep 16 --global_batch 1024
    # the cluster-scale table of docs/performance/ep-overlap-planner.md
    python scripts/performance/ep_overlap_plan.py --table
    # pipelines: the plain 1F1B one and, with --vpp, the interleaved one
    python scripts/performance/ep_overlap_plan.py --model qwen3-30b-a3b --gpus 32 --ep 8 --pp 4 --vpp 2
    # another dispatcher backend (alltoall by default), the SMs its kernels hold
    python scripts/performance/ep_overlap_plan.py --model qwen3-30b-a3b --dispatcher hybridep --num_sms 32
    # a Megatron-Bridge recipe as it is, on the hardware its name says (built offline once, then cached)
    python scripts/performance/ep_overlap_plan.py --recipe perf_recipes.qwen3_30b_a3b_pretrain_16gpu_h100_bf16_config
    # every performance recipe the recipe check lists, one row each
    python scripts/performance/ep_overlap_plan.py --all_recipes

It prices the engine's own schedule program (``ep_overlap_lab.planner``); nothing runs on a
GPU, and it needs no torch.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

DEFAULT_COUNTS = [1, 2, 4, 8, 16, 32, 64]
PROFILE_NAMES = ("H100", "H200", "B200", "B300", "GB200", "GB300", "GB200-NVL8", "GB300-NVL8")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--from_json", help="the harness's --json output (an --ab run): costs from its baseline arm")
    source.add_argument("--model", choices=["qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"], help="a published shape")
    source.add_argument("--table", action="store_true", help="print the cluster-scale table (Markdown)")
    source.add_argument("--recipe", help="a Megatron-Bridge recipe: perf_recipes.NAME, recipes.NAME or NAME")
    source.add_argument("--all_recipes", action="store_true", help="every performance recipe the recipe check lists")
    parser.add_argument("--profile", choices=list(PROFILE_NAMES), default=None, help="hardware (default: H100, or "
                        "with --recipe the recipe's name's)")  # fmt: skip
    parser.add_argument("--dispatcher", choices=["alltoall", "deepep", "hybridep", "ncclep"], default=None,
                        help="with --model: the token dispatcher backend (default alltoall)")  # fmt: skip
    parser.add_argument("--num_sms", type=int, default=None, help="with --dispatcher: SMs its kernels hold")
    parser.add_argument("--gpus", type=int, default=None, help="with --model (default 16)")
    parser.add_argument("--ep", type=int, default=None, help="with --model: expert-parallel size (default 16)")
    parser.add_argument("--global_batch", type=int, default=None, help="with --model: sequences (default 1024)")
    parser.add_argument("--link_gbps", type=float, default=None, help="with --from_json: predict for this link")
    parser.add_argument("--microbatches", type=int, nargs="+", default=None, help="microbatch counts to search")
    parser.add_argument("--pp", type=int, default=None, help="with --model: pipeline stages (prices 1F1B)")
    parser.add_argument("--vpp", type=int, default=None, help="with --pp: virtual stages (prices it too)")
    parser.add_argument(
        "--recompute_modules",
        nargs="+",
        default=None,
        choices=["layernorm", "core_attn", "moe_act", "mlp", "moe"],
        help="with --model: charge these recomputed forwards to the backward nodes that run them",
    )
    return parser


def _line(label: str, comparison) -> str:
    base, over = comparison.baseline, comparison.overlap
    return (
        f"{label}: plain {base.step_s:.3f} s, overlapped {over.step_s:.3f} s, speedup {comparison.speedup:.3f}x, "
        f"h {comparison.h:.2f} (exposed comm {base.exposed_total_s:.3f} -> {over.exposed_total_s:.3f} s: "
        + ", ".join(f"{k} {v:.3f}" for k, v in over.exposed_s.items())
        + ")"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from utils.quiet import quiet_third_party_imports

    with quiet_third_party_imports():
        from ep_overlap_lab import planner

    problems, run = _measured_inputs(args)
    if problems:
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.table:
        from utils.plan_table import cluster_table

        print(cluster_table())
        return 0
    if args.recipe or args.all_recipes:
        from utils.plan_recipe import print_recipes

        return print_recipes(args)
    if args.pp is not None and args.pp > 1:
        return _print_pipelines(args, run)
    costs, link, n, heading = run[:4] if args.from_json else _model_inputs(args)
    try:
        first = planner.predict(costs, link, n)
    except ValueError as exc:  # what the costs cannot price (no communication at all), before any figure
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(heading)
    print(f"link: {link.bandwidth_Bps / 1e9:.3f} GB/s effective, {link.latency_s * 1e6:.0f} us per all-to-all")
    _print_predictions(planner, costs, link, n, first, args.microbatches)
    return 0


def _measured_inputs(args) -> tuple[list[str], tuple | None]:
    """The flags' problems and, with --from_json, the measured run's (costs, link, microbatches, heading)."""
    from utils.plan_inputs import PlanInputError, flag_problems, read_measured

    from ep_overlap_lab import planner
    from ep_overlap_lab.planner import cost_model

    problems = flag_problems(args, cost_model.SHAPES[args.model].num_experts if args.model else None)
    if problems or not args.from_json:
        return problems, None
    try:
        run = read_measured(args.from_json)
        costs, link = planner.costs_from_records(
            run.records, run.step_times_s, args.link_gbps or run.link_gbps, run.num_layers
        )
    except PlanInputError as exc:
        return [str(exc)], None
    except (KeyError, TypeError, ValueError) as exc:
        return [f"--from_json={args.from_json}: a step record is malformed ({exc!r}); rerun the harness"], None
    heading = f"costs from {args.from_json} (rank 0's baseline records, steps {run.first_step}..{run.last_step})"
    return [], (costs, link, run.num_microbatches, heading, run.activation_bytes)


def _model_inputs(args) -> tuple:
    """A published shape's (costs, link, microbatches, heading), the heading with its activation memory."""
    from utils.plan_inputs import model_layout
    from utils.plan_table import activation_peaks_gib

    from ep_overlap_lab.planner import cost_model

    layout = cost_model.Layout(*model_layout(args))
    recompute = frozenset(args.recompute_modules or ())
    shape, profile = cost_model.SHAPES[args.model], cost_model.PROFILES[args.profile or "H100"]
    dispatcher = cost_model.Dispatcher(args.dispatcher or "alltoall", args.num_sms)
    costs, link = cost_model.costs_from_model(shape, layout, profile, recompute, dispatcher=dispatcher)
    plain, overlap, delayed, edges = activation_peaks_gib(shape, layout, recompute)
    heading = (
        f"{args.model} on {layout.gpus} x {args.profile or 'H100'}, EP {layout.ep}, global batch "
        f"{layout.global_batch}, {dispatcher.backend}" + (f" ({dispatcher.sms} SMs)" if args.num_sms else "") + "\n"
        "activations held per rank (all layers, balanced routing; an estimate"
        + (f", recomputing {' '.join(sorted(recompute))}: at most this" if recompute else "")
        + f"): plain {plain:.1f} GiB, overlapped {overlap:.1f}, with delayed wgrad {delayed:.1f}, with edge "
        f"pairing {edges:.1f}"
    )
    return costs, link, layout.num_microbatches, heading


def _print_pipelines(args, measured) -> int:
    """A pipeline's prices: a --model's on its stages (with memory), or a measured PP = 1 run's costs on P stages
    of the same ranks each (the layers split over them, the same microbatches)."""
    from utils.plan_inputs import model_layout
    from utils.plan_pipeline import measured_pipeline_lines, pipeline_lines

    from ep_overlap_lab.planner import cost_model

    try:
        if measured is not None:
            costs, link, n, heading, activation_bytes = measured
            lines = measured_pipeline_lines(costs, link, n, args.pp, args.vpp, activation_bytes)
        else:
            layout = cost_model.Layout(*model_layout(args))
            shape, profile = cost_model.SHAPES[args.model], cost_model.PROFILES[args.profile or "H100"]
            heading = (
                f"{args.model} on {layout.gpus} x {args.profile or 'H100'}, EP {layout.ep}, global batch "
                f"{layout.global_batch}"
            )
            lines = pipeline_lines(shape, layout, profile, args.pp, args.vpp)
    except ValueError as exc:  # layers that do not split over the stages
        print(f"error: --pp={args.pp} --vpp={args.vpp}: {exc}", file=sys.stderr)
        return 2
    print(heading)
    print("\n".join(lines))
    return 0


def _print_predictions(planner, costs, link, n: int, first, microbatches) -> None:
    from megatron.bridge.training.ep_overlap.options import EPOverlapOptions

    print(_line(f"{n} microbatches", first))
    for window in (1, 2):
        comparison = planner.predict(costs, link, n, EPOverlapOptions(delay_wgrad=True, attention_wgrad_window=window))
        print(_line(f"{n} microbatches, delayed wgrad, attention wgrad in window {window}", comparison))
    counts = microbatches or [c for c in DEFAULT_COUNTS if c <= max(n, 1) * 4]
    best = planner.best_choice(costs, link, counts)[0]
    print(
        f"best of {counts}: {best.num_microbatches} microbatches"
        + (f", delayed wgrad, attention wgrad in window {best.wgrad_window}" if best.delay_wgrad else "")
        + " "
        f"({best.overlap.step_s / best.num_microbatches:.3f} s per microbatch overlapped, speedup {best.speedup:.3f}x)"
    )


if __name__ == "__main__":
    sys.exit(main())
