"""Launching the harness's arms: on local ranks (over an emulated link when asked) or under torchrun, with the
console's progress, and the settings a result was measured under."""

import contextlib
import dataclasses
import os
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from argument_parser import MODEL_INT_FLAGS, PIPELINE_FLAGS

from ep_overlap_lab.multiprocess import (
    run_local_ranks,
)
from utils.arms import ArmSpec, run_arms, step_line
from utils.netns import EmulatedLink
from utils.recipe import RecipeConfig


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
    arms: list[dict],
    recipe: RecipeConfig,
    device: str,
    model_impl: str = "reference",
    profile_dir: str | None = None,
    pipeline_schedule: str | None = None,
) -> list[ArmSpec]:
    """One spec per arm (see :func:`arms_of`); a Megatron-Core pipeline's arms run ``pipeline_schedule`` (default:
    1F1B, or interleaved with virtual stages)."""
    m = recipe.model
    schedule = None
    if model_impl == "mcore" and (m.pipeline_model_parallel_size or 1) > 1:
        default = "interleaved" if (m.virtual_pipeline_model_parallel_size or 1) > 1 else "1f1b"
        schedule = pipeline_schedule or default
    return [
        ArmSpec(a["name"], a["model"], a["options"], recipe.train, device, model_impl=model_impl,
                profile_dir=profile_dir, pipeline_schedule=schedule)
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
    arms: list[str] = field(default_factory=list)  # the arms of the run in progress
    _rank0: dict = field(default_factory=dict)  # (arm, step) -> rank 0's report, whose figures the console shows

    def record(self, rank: int, report: dict) -> None:
        reports = self.finished.setdefault(report["arm"], [])
        reports.append(report)
        if rank == 0:
            self._rank0[(report["arm"], report["step"])] = report
        if self.echo and sum(1 for r in reports if r["step"] == report["step"]) == self.ranks:
            print(step_line(self._rank0.get((report["arm"], report["step"]), report), self.max_steps), flush=True)

    def all_done(self) -> bool:
        """Every rank reported the last step of every arm: what is left is returning the results."""
        last = self.max_steps
        return bool(self.arms) and all(
            sum(1 for r in self.finished.get(arm, []) if r["step"] == last) == self.ranks for arm in self.arms
        )

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
    progress.arms = [spec.name for spec in specs]
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
            finish_after_interrupt=progress.all_done,
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
