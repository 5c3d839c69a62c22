"""The harness's summary of a finished run: each arm's figures, the matched A/B, the schedules, and the planner's
prediction beside the measurement."""

import statistics
from dataclasses import replace

from ep_overlap_lab.pipeline_layout import chunk_layers_of
from ep_overlap_lab.planner import costs_from_records, exposed_by_phase, predict
from ep_overlap_lab.planner.memory import ActivationShape, pipeline_peaks
from ep_overlap_lab.program.steps import format_program, program
from megatron.bridge.training.ep_overlap.options import EPOverlapOptions
from megatron.bridge.training.ep_overlap.program.steps import ChunkShape
from megatron.bridge.training.ep_overlap.settings import resolve
from utils.launch import run_config
from utils.recipe import RecipeConfig
from utils.report import bitwise_equal, summarize_arm
from utils.stats import matched_ab


def _pipeline(model) -> tuple[int, int]:
    return model.pipeline_model_parallel_size or 1, model.virtual_pipeline_model_parallel_size or 1


def _programs(model, num_microbatches: int, options: EPOverlapOptions) -> list[list]:
    """Every pipeline rank's schedule program for the reference model of ``model`` (its chunks as the engine
    builds them)."""
    P, _ = _pipeline(model)
    layers = chunk_layers_of(model)
    shapes = [
        ChunkShape(
            c == 0,
            c == len(layers) - 1,
            tuple(model.is_moe_layer(j) for j in layers[c]),
            resolve(model).segments(len(layers[c])),
        )  # fmt: skip
        for c in range(len(layers))
    ]
    return [list(program(options, shapes[rank::P], num_microbatches, pipeline_size=P, rank=rank)) for rank in range(P)]


def pairing_bound(model, num_microbatches: int, options: EPOverlapOptions) -> float:
    """The share of forward passes that run beside another microbatch on the least-paired rank: overlap cannot
    hide the rest's all-to-alls ((N-1)/N with PP = 1 without edge pairing or chunking, 1 with either)."""
    _, V = _pipeline(model)
    shares = [
        sum(len({u.microbatch for u in s.units if u.role == "F"}) for s in steps if s.kind != "forward")
        / (num_microbatches * V)
        for steps in _programs(model, num_microbatches, replace(options, overlap=True))
    ]
    return min(shares)


def layout_name(P: int, V: int) -> str:
    """``PP 2 x VPP 2``, or ``PP 2 (1F1B)`` without virtual stages; empty at PP = 1."""
    return "" if P == 1 else f"PP {P} x VPP {V}" if V > 1 else f"PP {P} (1F1B)"


def print_schedules(model, num_microbatches: int, options: EPOverlapOptions, pipeline_schedule: str | None = None):
    P, V = _pipeline(model)
    if pipeline_schedule == "dualpipev":  # Megatron-Core chunks run DualPipeV's op list, not the engine's program
        from ep_overlap_lab.program.dualpipev import Costs, draw_timeline, simulate_dualpipev

        print(
            f"schedule (overlap {'on' if options.overlap else 'off'}): PP {P} DualPipeV, {num_microbatches} "
            "microbatches, timed with F = 1, B = 2, F&B = 2 per stage (3 characters a unit); F/B stage r's, f/b "
            "stage 2P-1-r's, then the microbatch; F3b1 an F&B step; . idle"
        )
        print(
            draw_timeline(simulate_dualpipev(P, num_microbatches, overlap=options.overlap, costs=Costs(1, 2, 0, 2)), 3)
        )
        return
    print(
        f"schedule (overlap on): {layout_name(P, V) or 'PP 1'}, {num_microbatches} microbatches; units F/B "
        "u<unit>=m<microbatch>"
        "[.half] c<chunk>, <received >sent transfer@r<pipeline rank>; then each window's ops in host order"
    )
    for rank, steps in enumerate(_programs(model, num_microbatches, replace(options, overlap=True))):
        print(format_program(steps, rank, P))


def summarize(results: dict[str, list[dict]], recipe: RecipeConfig, args, device: str, world: int) -> dict:
    t, m = recipe.train, recipe.model
    P, V = _pipeline(m)
    tokens_per_step = world // P * t.num_microbatches * t.micro_batch_size * m.seq_length
    link = f"{args.link_gbps:g} Gbit/s emulated link" if args.link_gbps else "loopback"
    layout = f"{layout_name(P, V)}, " if P > 1 else ""
    if next(iter(results.values()))[0].get("pipeline_schedule") == "dualpipev":
        layout = f"PP {P} DualPipeV (stages r and 2P-1-r per rank), "
    summary = {
        "title": (
            f"EP overlap {'A/B' if args.ab else 'run'}: {world} ranks, {layout}EP {m.expert_model_parallel_size}, "
            f"{t.num_microbatches} microbatches x {t.micro_batch_size * m.seq_length} tokens, "
            f"{'bf16' if m.bf16 else 'fp32'}, {device}, {link}; steady steps {t.warmup_steps + 1}..{t.max_steps}"
        ),
        "config": run_config(recipe, args, device, world),
        "arms": {name: summarize_arm(per_rank, t.warmup_steps, tokens_per_step) for name, per_rank in results.items()},
        "recompute_modules": list(m.recompute_modules or ()) if m.recompute_granularity == "selective" else [],
        "recompute": {
            "granularity": m.recompute_granularity,
            "method": m.recompute_method,
            "num_layers": m.recompute_num_layers,
        },
    }
    placement = results["overlap" if args.ab else "run"][0].get("placement")
    if placement:
        summary["placement"] = placement
    if args.ab:
        summary["numerics"] = bitwise_equal(results["baseline"], results["overlap"])
        summary["numerics"]["expected_bitwise"] = args.moe_ep_overlap_chunks == 1
        held = {arm: summary["arms"][arm]["activation_peak_bytes"] for arm in ("baseline", "overlap")}
        summary["activation_peak_bytes"] = {**held, "ratio": held["overlap"] / held["baseline"]}
        # The planner's accounting is the reference model's (with recompute, an upper bound: planner/memory.py).
        if args.model_impl == "reference":  # the most any rank holds, as measured
            shape = ActivationShape.of_reference_model(m, t.micro_batch_size)
            summary["activation_peak_bytes"]["planned_balanced_routing"] = {
                arm: max(
                    pipeline_peaks(shape, EPOverlapOptions(**results[arm][0]["options"]), t.num_microbatches, P, V)
                )
                for arm in ("baseline", "overlap")
            }
        summary.update(matched_ab(results["baseline"], results["overlap"], t.warmup_steps))
        schedule = results["overlap"][0].get("pipeline_schedule")
        if schedule:  # a Megatron-Core pipeline: the reference model's program below is not the one that ran
            summary["pipeline_schedule"] = schedule
        else:
            options = EPOverlapOptions(**results["overlap"][0]["options"])
            summary["bound"] = pairing_bound(m, t.num_microbatches, options)
        if args.predict:
            summary["prediction"] = prediction_from_baseline(results, recipe, args)
    return summary


def prediction_from_baseline(results: dict[str, list[dict]], recipe: RecipeConfig, args) -> dict:
    """The planner fed with rank 0's baseline records, beside what the overlap arm measured (per phase too)."""
    warmup = recipe.train.warmup_steps
    base, over = results["baseline"][0], results["overlap"][0]
    model = recipe.model
    costs, link = costs_from_records(
        base["records"][warmup:], base["step_times_s"][warmup:], args.link_gbps, model.num_layers,
        resolve(model).segments(model.num_layers),
    )  # fmt: skip
    comparison = predict(costs, link, recipe.train.num_microbatches, EPOverlapOptions(**over["options"]))
    measured = [exposed_by_phase(step) for step in over["records"][warmup:]]
    phases = sorted({phase for step in measured for phase in step})
    return {
        "baseline_step_s": comparison.baseline.step_s,
        "overlap_step_s": comparison.overlap.step_s,
        "h": comparison.h,
        "speedup": comparison.speedup,
        "link": {"bandwidth_Bps": link.bandwidth_Bps, "latency_s": link.latency_s},
        "exposed_comm_s_by_phase": {
            phase: {
                "predicted": comparison.overlap.exposed_s.get(phase, 0.0),
                "measured": statistics.median(step.get(phase, 0.0) for step in measured),
            }
            for phase in phases
        },
    }
