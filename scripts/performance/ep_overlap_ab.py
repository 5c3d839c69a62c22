"""MoE EP-overlap performance harness: one arm, or a matched A/B (overlap off vs on) in one invocation.

    python scripts/performance/ep_overlap_ab.py --ab --link_gbps 1 --json out/ab.json --timeline out/timeline.png

Under torchrun it uses the launcher's environment (multi-node works as torchrun does). Started plainly it
spawns ``--nproc_per_node`` local ranks: gloo on CPU, NCCL on GPU. With ``--link_gbps`` (root) each local rank
gets its own network namespace behind a link shaped to that rate, so all-to-all is wire-bound as between nodes.
Config errors are printed as the rules' one error, without a traceback, and exit with status 2.
"""

import contextlib
import dataclasses
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from argument_parser import MODEL_INT_FLAGS, parse_cli_args  # noqa: E402
from utils.arms import ArmSpec, run_arm  # noqa: E402
from utils.netns import EmulatedLink, LinkUnavailable  # noqa: E402
from utils.overrides import OverrideError, apply_flag_overrides, apply_overrides  # noqa: E402
from utils.recipe import RecipeConfig, small_moe_recipe  # noqa: E402
from utils.report import bitwise_equal, draw_timeline, format_table, summarize_arm, write_json  # noqa: E402

from megatron.bridge.training.comm_overlap import CommOverlapConfigError  # noqa: E402
from megatron.bridge.training.flex_dispatcher_backend import (  # noqa: E402
    FlexDispatcherConfigError,
    validate_flex_dispatcher_backend,
)
from megatron.bridge.utils.multiprocess import RankFailure, launched_by_torchrun, run_local_ranks  # noqa: E402


class ConfigError(Exception):
    """A configuration problem, printed to the user without a traceback."""


def build_recipe(args) -> RecipeConfig:
    """The recipe with flags, then key=value overrides, applied; the model config re-validated."""
    recipe = small_moe_recipe()
    try:
        apply_flag_overrides(recipe, args)
        apply_overrides(recipe, args.overrides)
        # Re-run the model config's own validation on the overridden values (Bridge's finalize()).
        recipe.model = dataclasses.replace(recipe.model)
        recipe.comm_overlap.finalize()
        validate_flex_dispatcher_backend(recipe.model)
    except (OverrideError, FlexDispatcherConfigError, CommOverlapConfigError) as exc:
        raise ConfigError(str(exc)) from exc
    except (AssertionError, ValueError) as exc:
        raise ConfigError(f"model config: {exc}") from exc
    if recipe.model.moe_token_dispatcher_type == "flex":
        raise ConfigError(
            f"moe_flex_dispatcher_backend={recipe.model.moe_flex_dispatcher_backend!r}: the harness's models run the "
            "alltoall dispatcher only; drop --moe_flex_dispatcher_backend"
        )
    if recipe.model.cuda_graph_impl != "none":
        raise ConfigError(
            f"cuda_graph_impl={recipe.model.cuda_graph_impl!r}: the harness's reference model does not capture CUDA "
            "graphs; use --cuda_graph_impl none"
        )
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
        raise ConfigError(f"{name} arm: {exc}") from exc
    return {
        "name": name,
        "model": model,
        "overlap": bool(model.overlap_moe_expert_parallel_comm),
        "delay_wgrad": bool(model.delay_wgrad_compute),
    }


def plan_arms(recipe: RecipeConfig, ab: bool) -> list[dict]:
    if not ab:
        return [resolve_arm(recipe, "run", None, None)]
    # The overlap arm keeps the config's delayed-wgrad choice; the baseline turns both knobs off.
    return [resolve_arm(recipe, "baseline", False, False), resolve_arm(recipe, "overlap", True, None)]


def pick_device(args) -> str:
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available on this host")
    if args.model_impl == "mcore" and device != "cuda":
        raise ConfigError(
            "--model_impl mcore runs Megatron-Core layers, which need CUDA (on CPU they run only under the test "
            "fixture); this run is on CPU. Use --model_impl reference, or a host with a GPU"
        )
    return device


def describe(recipe: RecipeConfig, arms: list[dict], args, device: str, world: int) -> str:
    m, t = recipe.model, recipe.train
    lines = ["resolved config:"]
    for key in (*MODEL_INT_FLAGS, "moe_layer_freq", "vocab_size", "moe_token_dispatcher_type", "bf16"):
        lines.append(f"  model.{key} = {getattr(m, key)!r}")
    for key, value in vars(t).items():
        lines.append(f"  train.{key} = {value!r}")
    for arm in arms:
        lines.append(
            f"  arm {arm['name']}: overlap_moe_expert_parallel_comm={arm['overlap']}, "
            f"delay_wgrad_compute={arm['delay_wgrad']}"
        )
    link = f"{args.link_gbps:g} Gbit/s emulated" if args.link_gbps else "loopback"
    lines.append(f"  launch: {world} ranks, device {device}, link {link}, model_impl {args.model_impl}")
    return "\n".join(lines)


def specs_for(arms: list[dict], recipe: RecipeConfig, device: str, model_impl: str = "reference") -> list[ArmSpec]:
    return [
        ArmSpec(a["name"], a["model"], a["overlap"], a["delay_wgrad"], recipe.train, device, model_impl=model_impl)
        for a in arms
    ]


def run_local(specs: list[ArmSpec], args, device: str) -> dict[str, list[dict]]:
    """Each arm in fresh local rank processes (so each arm's peak memory is its own)."""
    backend = "nccl" if device == "cuda" else "gloo"
    results = {}
    with EmulatedLink(args.nproc_per_node, args.link_gbps) if args.link_gbps else contextlib.nullcontext() as link:
        for spec in specs:
            print(f"running arm '{spec.name}' on {args.nproc_per_node} ranks ...", flush=True)
            outcomes = run_local_ranks(
                _local_rank_main,
                args.nproc_per_node,
                (spec,),
                backend=backend,
                collective_timeout_s=spec.train.collective_timeout_s,
                rank_setup=link.rank_setup() if link else None,
                master_addr=link.master_addr if link else "127.0.0.1",
            )
            results[spec.name] = [o.result for o in outcomes]
    return results


def _local_rank_main(rank: int, world: int, spec: ArmSpec) -> dict:
    if spec.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    return run_arm(rank, world, spec)


def run_torchrun(specs: list[ArmSpec], device: str) -> dict[str, list[dict]] | None:
    """All arms in this process, one after the other; rank 0 gets every rank's results."""
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    try:
        results = {}
        for spec in specs:
            mine = run_arm(dist.get_rank(), dist.get_world_size(), spec)
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            results[spec.name] = gathered
        return results if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()


def summarize(results: dict[str, list[dict]], recipe: RecipeConfig, args, device: str, world: int) -> dict:
    t, m = recipe.train, recipe.model
    tokens_per_step = world * t.num_microbatches * t.micro_batch_size * m.seq_length
    link = f"{args.link_gbps:g} Gbit/s emulated link" if args.link_gbps else "loopback"
    summary = {
        "title": (
            f"EP overlap {'A/B' if args.ab else 'run'}: {world} ranks, EP {m.expert_model_parallel_size}, "
            f"{t.num_microbatches} microbatches x {t.micro_batch_size * m.seq_length} tokens, "
            f"{'bf16' if m.bf16 else 'fp32'}, {device}, {link}; steady steps {t.warmup_steps + 1}..{t.max_steps}"
        ),
        "config": {
            "model": {
                k: getattr(m, k)
                for k in (
                    "num_layers",
                    "hidden_size",
                    "num_moe_experts",
                    "moe_router_topk",
                    "seq_length",
                    "expert_model_parallel_size",
                    "bf16",
                )
            },
            "train": vars(t),
            "world_size": world,
            "device": device,
            "link_gbps": args.link_gbps,
        },
        "arms": {name: summarize_arm(per_rank, t.warmup_steps, tokens_per_step) for name, per_rank in results.items()},
    }
    if args.ab:
        summary["numerics"] = bitwise_equal(results["baseline"], results["overlap"])
        summary["speedup"] = (
            summary["arms"]["baseline"]["median_step_time_s"] / summary["arms"]["overlap"]["median_step_time_s"]
        )
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_cli_args(argv)
    try:
        recipe = build_recipe(args)
        arms = plan_arms(recipe, args.ab)
        device = pick_device(args)
        torchrun = launched_by_torchrun()
        world = int(os.environ["WORLD_SIZE"]) if torchrun else args.nproc_per_node
        if not args.dryrun and world % recipe.model.expert_model_parallel_size:
            raise ConfigError(
                f"{world} ranks cannot hold expert_model_parallel_size={recipe.model.expert_model_parallel_size}; "
                "use --nproc_per_node that is a multiple of it"
            )
        if args.dryrun:
            print(describe(recipe, arms, args, device, world))
            return 0
        if torchrun and args.link_gbps:
            raise ConfigError(
                "--link_gbps emulates links between local ranks; under torchrun the real network is used"
            )
        specs = specs_for(arms, recipe, device, args.model_impl)
        results = run_torchrun(specs, device) if torchrun else run_local(specs, args, device)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except LinkUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    except RankFailure as exc:
        print(f"error: a rank failed:\n{exc}", file=sys.stderr)
        return 1
    if results is None:  # torchrun ranks other than 0
        return 0
    summary = summarize(results, recipe, args, device, world)
    print(format_table(summary))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        write_json(summary, args.json_path)
        print(f"results written to {args.json_path}")
    if args.timeline:
        Path(args.timeline).parent.mkdir(parents=True, exist_ok=True)
        draw_timeline(summary, args.timeline)
        print(f"timeline of one steady step per arm drawn to {args.timeline}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
