"""The A/B harness's run: recipe, validation, arms, launching, summary. Imported by ``ep_overlap_ab.py`` once the
command line is parsed, so ``--help`` and flag errors never import torch.

Every check runs in the parent before any rank starts: a problem is one line (field, value, fix) and exit
status 2. A run ends when it finishes, fails, is stopped (SIGINT/SIGTERM), or no rank reports a finished step
for the stall timeout; whatever steps finished are kept in the JSON.
"""

import contextlib
import dataclasses
import os
import statistics
import sys
from collections import Counter
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from argument_parser import MODEL_INT_FLAGS, PIPELINE_FLAGS

from megatron.bridge.training.ep_overlap.options import EPOverlapOptions
from megatron.bridge.training.ep_overlap.planner import costs_from_records, exposed_by_phase, predict
from megatron.bridge.training.ep_overlap.planner.memory import ActivationShape, predicted_peak
from megatron.bridge.training.ep_overlap.program.steps import ChunkShape, format_program, program
from megatron.bridge.training.ep_overlap.segments import recompute_segments
from megatron.bridge.training.moe_overlap_rules import CommOverlapConfigError, check_ep_overlap_options
from megatron.bridge.utils.multiprocess import (
    RankFailure,
    launched_by_torchrun,
    run_local_ranks,
)
from megatron.bridge.utils.pipeline_layout import chunk_layers_of
from utils.arms import ArmSpec, run_arms, step_line
from utils.checks import (
    flag_problems,
    lift_model_overlap_flags,
    model_impl_problems,
    pipeline_dtype_auto,
    recipe_problems,
    run_problems,
)
from utils.netns import EmulatedLink, LinkUnavailable
from utils.overrides import apply_flag_overrides, apply_overrides
from utils.recipe import RecipeConfig, small_moe_recipe
from utils.report import bitwise_equal, draw_timeline, format_table, partial_summary, save_json, summarize_arm
from utils.stats import matched_ab
from utils.stopping import IGNORED, STOPPING, signal_handlers, stopped_by


class ConfigError(Exception):
    """Configuration problems, printed one per line without a traceback (exit status 2)."""

    def __init__(self, problems: list[str]):
        self.problems = [" ".join(str(p).split()) for p in problems]
        super().__init__("\n".join(self.problems))


def _violation_lines(exc: CommOverlapConfigError, prefix: str = "") -> list[str]:
    return [f"{prefix}{violation}" for violation in exc.violations]


def build_recipe(args) -> RecipeConfig:
    """The recipe with flags, then key=value overrides, applied and every value checked.

    Raises:
        ConfigError: Listing every problem found.
    """
    recipe, problems = _recipe_with_problems(args)
    if problems:
        raise ConfigError(problems)
    return _finalized(recipe)


def _recipe_with_problems(args) -> tuple[RecipeConfig, list[str]]:
    """Flags and overrides applied (bad overrides are reported, not applied), and every problem of the result."""
    recipe = small_moe_recipe()
    apply_flag_overrides(recipe, args)
    problems = apply_overrides(recipe, args.overrides)
    # Fields the model config derived from the recipe's own shape: derived again from the final one (finalize),
    # unless an override set them. Kept, they would give a Megatron-Core model the recipe's head size.
    given = {item.partition("=")[0].strip() for item in args.overrides}
    for name in ("kv_channels", "num_query_groups"):
        if f"model.{name}" not in given:
            setattr(recipe.model, name, None)
    problems += lift_model_overlap_flags(recipe)
    problems += model_impl_problems(recipe.model, args.model_impl, args.num_layers)
    problems += recipe_problems(recipe)
    if not problems:
        pipeline_dtype_auto(recipe.model)
    return recipe, problems


def _finalized(recipe: RecipeConfig) -> RecipeConfig:
    """The comm_overlap and Megatron-Core's own model-config validation, once our checks found nothing."""
    try:
        recipe.comm_overlap.finalize()
    except CommOverlapConfigError as exc:
        raise ConfigError(_violation_lines(exc)) from exc
    try:
        # Re-run the model config's own validation on the overridden values (Bridge's finalize()).
        recipe.model = dataclasses.replace(recipe.model)
    except (AssertionError, ValueError) as exc:
        raise ConfigError([f"model config: {exc}"]) from exc
    return recipe


def resolve_arm(recipe: RecipeConfig, name: str, overlap: bool | None, delay: bool | None) -> dict:
    """Resolves one arm's model config through CommOverlapConfig.setup (the rules run here)."""
    model = dataclasses.replace(recipe.model)
    comm_overlap = dataclasses.replace(recipe.comm_overlap)
    if overlap is not None:
        comm_overlap.overlap_moe_expert_parallel_comm = overlap
    if delay is not None:
        comm_overlap.delay_wgrad_compute = delay
    try:
        comm_overlap.setup(model)
    except CommOverlapConfigError as exc:
        raise ConfigError(_violation_lines(exc, f"{name} arm: ")) from exc
    return {
        "name": name,
        "model": model,
        "overlap": bool(model.overlap_moe_expert_parallel_comm),
        "delay_wgrad": bool(model.delay_wgrad_compute),
    }


def plan_arms(recipe: RecipeConfig, args) -> list[dict]:
    """The arms of a run, each with its model config and the schedule's options (``options``): the flags' options
    go to the arm that runs the overlap schedule (a single run: to its one arm), the A/B baseline runs plain."""
    if not args.ab:
        arms = [resolve_arm(recipe, "run", None, None)]
    else:  # the overlap arm keeps the config's delayed-wgrad choice; the baseline turns both knobs off
        arms = [resolve_arm(recipe, "baseline", False, False), resolve_arm(recipe, "overlap", True, None)]
    for arm in arms:
        arm["options"] = (
            EPOverlapOptions(overlap=False)
            if arm["name"] == "baseline"
            else EPOverlapOptions(
                overlap=arm["overlap"],
                delay_wgrad=arm["delay_wgrad"],
                attention_wgrad_window=args.attention_wgrad_window,
                edge_pairing=args.edge_pairing,
                moe_ep_overlap_chunks=args.moe_ep_overlap_chunks,
                launch_off_host=args.launch_off_host,
            )
        )
    return arms


def options_problems(arms: list[dict], recipe: RecipeConfig) -> list[str]:
    """Each arm's schedule options against the rules table: the lines the engine would raise, before any rank."""
    return [
        f"{arm['name']} arm: {violation}"
        for arm in arms
        for violation in check_ep_overlap_options(
            arm["model"], arm["options"], micro_batch_size=recipe.train.micro_batch_size
        )
    ]


def pick_device(args) -> str:
    return ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device


def describe(recipe: RecipeConfig, arms: list[dict], args, device: str, world: int) -> str:
    m, t = recipe.model, recipe.train
    lines = ["resolved config:"]
    for key in (
        *MODEL_INT_FLAGS,
        *PIPELINE_FLAGS,
        "moe_layer_freq",
        "vocab_size",
        "moe_token_dispatcher_type",
        "bf16",
    ):
        lines.append(f"  model.{key} = {getattr(m, key)!r}")
    recompute = ("recompute_granularity", "recompute_modules") if m.recompute_granularity == "selective" else ()
    if m.recompute_granularity == "full":
        recompute = ("recompute_granularity", "recompute_method", "recompute_num_layers")
    for key in (*recompute, "mtp_num_layers", "hybrid_layer_pattern"):
        if getattr(m, key) is not None:
            lines.append(f"  model.{key} = {getattr(m, key)!r}")
    for key, value in vars(t).items():
        lines.append(f"  train.{key} = {value!r}")
    for arm in arms:
        # the flags as the model config resolved them, then (for the overlap schedule) the schedule's options
        options = dataclasses.asdict(arm["options"]) if arm["overlap"] else {}
        shown = {"overlap_moe_expert_parallel_comm": arm["overlap"], "delay_wgrad_compute": arm["delay_wgrad"]}
        shown |= {key: value for key, value in options.items() if key not in ("overlap", "delay_wgrad")}
        lines.append(f"  arm {arm['name']}: " + ", ".join(f"{key}={_auto(value)}" for key, value in shown.items()))
    link = f"{args.link_gbps:g} Gbit/s emulated" if args.link_gbps else "loopback"
    lines.append(f"  launch: {world} ranks, device {device}, link {link}, model_impl {args.model_impl}")
    return "\n".join(lines)


def specs_for(
    arms: list[dict], recipe: RecipeConfig, device: str, model_impl: str = "reference", profile_dir: str | None = None
) -> list[ArmSpec]:
    """One spec per arm (see :func:`plan_arms`)."""
    return [
        ArmSpec(a["name"], a["model"], a["options"], recipe.train, device, model_impl=model_impl,
                profile_dir=profile_dir)
        for a in arms
    ]  # fmt: skip


@dataclass
class Progress:
    """Steps finished so far, per arm (one report per rank and step), and the arm running now.

    The console line of a step is printed here, once every rank has reported it (with rank 0's figures), so a step
    the console shows is one every rank finished and the partial JSON holds.
    """

    finished: dict[str, list[dict]] = field(default_factory=dict)
    running: str | None = None
    max_steps: int = 0
    echo: bool = True
    ranks: int = 1
    _rank0: dict = field(default_factory=dict)  # (arm, step) -> rank 0's report, whose figures the console shows

    def record(self, rank: int, report: dict) -> None:
        reports = self.finished.setdefault(report["arm"], [])
        reports.append(report)
        if rank == 0:
            self._rank0[(report["arm"], report["step"])] = report
        if self.echo and sum(1 for r in reports if r["step"] == report["step"]) == self.ranks:
            print(step_line(self._rank0.get((report["arm"], report["step"]), report), self.max_steps), flush=True)

    def all_done(self, arms: list[str], ranks: int) -> bool:
        """Every rank reported the last step of every arm: what is left is returning the results."""
        return all(sum(1 for r in self.finished.get(arm, []) if r["step"] == self.max_steps) == ranks for arm in arms)

    def describe(self, steps: int) -> str:
        """Per arm, the last step every rank finished, and a later one only some ranks finished."""
        done = []
        for arm, reports in self.finished.items():
            counts = Counter(r["step"] for r in reports)
            everyone = max((step for step, n in counts.items() if n >= self.ranks), default=0)
            line = f"{arm} {everyone}/{steps} on every rank"
            ahead = max(counts)
            if ahead > everyone:
                line += f" (step {ahead} on {counts[ahead]} of {self.ranks} ranks)"
            done.append(line)
        return ", ".join(done) or "none"


def run_local(specs: list[ArmSpec], args, device: str, progress: Progress | None = None) -> dict[str, list[dict]]:
    """Every arm in the same local ranks, step by step in ABBA order (see ``utils.arms.run_arms``); the parent prints
    each finished step (``Progress``). An interrupt after every step finished still waits for the results."""
    progress = progress if progress is not None else Progress()
    progress.max_steps = specs[0].train.max_steps
    progress.ranks = args.nproc_per_node
    for spec in specs:
        spec.progress = False  # printed by the parent, as reports arrive
    backend = args.dist_backend if args.dist_backend != "auto" else ("nccl" if device == "cuda" else "gloo")
    with EmulatedLink(args.nproc_per_node, args.link_gbps) if args.link_gbps else contextlib.nullcontext() as link:
        if link is not None and link.removed_stale:
            print(
                f"note: removed {len(link.removed_stale)} network namespace(s) left by a run that was killed: "
                f"{' '.join(link.removed_stale)}",
                flush=True,
            )
        names = " and ".join(spec.name for spec in specs)
        progress.running = f"arm{'s' if len(specs) > 1 else ''} {names}"
        order = " interleaved step by step (ABBA)" if len(specs) > 1 else ""
        print(f"running {progress.running} on {args.nproc_per_node} ranks{order} ...", flush=True)
        outcomes = run_local_ranks(
            _local_rank_main,
            args.nproc_per_node,
            (specs,),
            backend=backend,
            collective_timeout_s=specs[0].train.collective_timeout_s,
            rank_setup=link.rank_setup() if link else None,
            master_addr=link.master_addr if link else "127.0.0.1",
            on_progress=progress.record,
            finish_after_interrupt=lambda: progress.all_done([spec.name for spec in specs], args.nproc_per_node),
        )
        progress.running = None
    return {spec.name: [o.result[spec.name] for o in outcomes] for spec in specs}


def _local_rank_main(rank: int, world: int, specs: list[ArmSpec]) -> dict:
    if specs[0].device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    return run_arms(rank, world, specs)


def run_torchrun(specs: list[ArmSpec], device: str) -> dict[str, list[dict]] | None:
    """All arms in these processes, interleaved as locally; rank 0 gets every rank's results."""
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    try:
        mine = run_arms(dist.get_rank(), dist.get_world_size(), specs)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        return {spec.name: [g[spec.name] for g in gathered] for spec in specs} if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()


def run_config(recipe: RecipeConfig, args, device: str, world: int) -> dict:
    """The settings a result was measured under, as the JSON records them."""
    keys = ("num_layers", "hidden_size", "num_moe_experts", "moe_router_topk", "seq_length")
    return {
        "model": {
            k: getattr(recipe.model, k)
            for k in (
                *keys,
                "expert_model_parallel_size",
                "pipeline_model_parallel_size",
                "virtual_pipeline_model_parallel_size",
                "bf16",
            )
        },  # fmt: skip
        "train": vars(recipe.train),
        "world_size": world,
        "device": device,
        "link_gbps": args.link_gbps,
        "attention_wgrad_window": _auto(args.attention_wgrad_window),
        "edge_pairing": args.edge_pairing,
        "moe_ep_overlap_chunks": args.moe_ep_overlap_chunks,
        "launch_off_host": _auto(args.launch_off_host),
    }


def _auto(value: bool | int | None) -> bool | int | str:
    """A setting as the report shows it: None (let the engine decide) is "auto"."""
    return "auto" if value is None else value


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
            recompute_segments(model, len(layers[c])),
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


def print_schedules(model, num_microbatches: int, options: EPOverlapOptions) -> None:
    P, V = _pipeline(model)
    print(
        f"schedule (overlap on): PP {P} x VPP {V}, {num_microbatches} microbatches; units F/B u<unit>=m<microbatch>"
        "[.half] c<chunk>, <received >sent transfer@r<pipeline rank>; then each window's ops in host order"
    )
    for rank, steps in enumerate(_programs(model, num_microbatches, replace(options, overlap=True))):
        print(format_program(steps, rank, P))


def summarize(results: dict[str, list[dict]], recipe: RecipeConfig, args, device: str, world: int) -> dict:
    t, m = recipe.train, recipe.model
    P, V = _pipeline(m)
    tokens_per_step = world // P * t.num_microbatches * t.micro_batch_size * m.seq_length
    link = f"{args.link_gbps:g} Gbit/s emulated link" if args.link_gbps else "loopback"
    layout = f"PP {P} x VPP {V}, " if P > 1 else ""
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
        if P == 1 and args.model_impl == "reference":
            shape = ActivationShape.of_reference_model(m, t.micro_batch_size)
            summary["activation_peak_bytes"]["planned_balanced_routing"] = {
                arm: predicted_peak(shape, EPOverlapOptions(**results[arm][0]["options"]), t.num_microbatches)
                for arm in ("baseline", "overlap")
            }
        summary.update(matched_ab(results["baseline"], results["overlap"], t.warmup_steps))
        summary["bound"] = pairing_bound(m, t.num_microbatches, EPOverlapOptions(**results["overlap"][0]["options"]))
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
        recompute_segments(model, model.num_layers),
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


def run(args) -> int:
    """The harness after argument parsing: check everything, run, report. Returns the exit status."""
    progress, recipe, partial_to = Progress(), None, None
    with signal_handlers(STOPPING):
        try:
            recipe, problems = _recipe_with_problems(args)
            torchrun = launched_by_torchrun()
            world = int(os.environ["WORLD_SIZE"]) if torchrun else args.nproc_per_node
            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            pipeline = recipe.model.pipeline_model_parallel_size
            problems += run_problems(
                args, world, recipe.model.expert_model_parallel_size, torchrun, gpus, pipeline if pipeline else 1
            )
            if args.predict and recipe.model.moe_token_dispatcher_type == "flex":
                problems.append(
                    "--predict: the planner prices each all-to-all by the bytes it moves, which a flex backend's "
                    "fused kernels do not report; drop --predict or the flex backend"
                )
            if problems:
                raise ConfigError(problems)
            recipe = _finalized(recipe)
            arms = plan_arms(recipe, args)
            problems = flag_problems(args, arms, recipe) + options_problems(arms, recipe)
            if problems:
                raise ConfigError(problems)
            device = pick_device(args)
            if args.print_schedule:
                print_schedules(recipe.model, recipe.train.num_microbatches, arms[-1]["options"])
            if args.dryrun:
                print(describe(recipe, arms, args, device, world))
                return 0
            partial_to = run_config(recipe, args, device, world)
            specs = specs_for(arms, recipe, device, args.model_impl, args.profile)
            results = run_torchrun(specs, device) if torchrun else run_local(specs, args, device, progress)
        except ConfigError as exc:
            for problem in exc.problems:
                print(f"error: {problem}", file=sys.stderr)
            return 2
        except LinkUnavailable as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 3
        except RankFailure as exc:
            for outcome in (exc.outcomes[rank] for rank in exc.first):  # a rank that died first is the cause
                if outcome.error:
                    lines = outcome.error.strip().splitlines()
                    print(f"error: rank {outcome.rank}: {lines[-1]}", file=sys.stderr)
                    if args.verbose:
                        print(outcome.error, file=sys.stderr)
            _keep_partial(args, progress, partial_to, f"failed while running {progress.running}")
            return 1
        except (KeyboardInterrupt, SystemExit) as exc:
            code, name = stopped_by(exc)
            where = f" while running {progress.running}" if progress.running else ""
            steps = recipe.train.max_steps if recipe else 0
            saved = _keep_partial(args, progress, partial_to, f"stopped by {name}")
            print(
                f"stopped by {name}{where}; every rank stopped; finished steps: {progress.describe(steps)}"
                + (f"; partial results written to {saved}" if saved else ""),
                file=sys.stderr,
            )
            return code
    if results is None:  # torchrun ranks other than 0
        return 0
    with signal_handlers(IGNORED):  # every step ran: an interrupt now would only lose the report
        summary = summarize(results, recipe, args, device, world)
        print(format_table(summary))
        status = 0
        if args.json_path:
            written, problem = save_json(summary, args.json_path)
            if problem:
                print(f"error: {problem}; the results are kept in {written}", file=sys.stderr)
                status = 1
            else:
                print(f"results written to {written}")
        traces = {name: arm.get("profile_trace") for name, arm in summary["arms"].items()}
        if any(traces.values()):
            print("traces of one more step per arm, profiled after the measured ones (not in the statistics): "
                  + ", ".join(f"{name} {path}" for name, path in traces.items() if path))  # fmt: skip
        if args.timeline:
            try:
                draw_timeline(summary, args.timeline)
                print(f"timeline of one steady step per arm drawn to {args.timeline}")
            except OSError as exc:
                print(f"error: --timeline={args.timeline!r}: cannot be written now ({exc.strerror or exc})",
                      file=sys.stderr)  # fmt: skip
                status = 1
    return status


def _keep_partial(args, progress: Progress, config: dict | None, status: str) -> str | None:
    """Writes what finished to --json (when given and a run had started); returns the path written."""
    if not args.json_path or config is None:
        return None
    written, problem = save_json(partial_summary(status, progress.finished, config), args.json_path)
    if problem:
        print(f"error: {problem}; the partial results are kept in {written}", file=sys.stderr)
    return written
