"""Everything the harness checks before any rank starts. Each problem is one line: the field, its value, the fix."""

import dataclasses
import importlib.util
import math
from pathlib import Path
from typing import Any

from argument_parser import MODEL_INT_FLAGS

from ep_overlap_lab.moe_gpt.config import model_feature_problems, router_problems
from ep_overlap_lab.pipeline_layout import chunk_layers_of
from megatron.bridge.training.ep_overlap.program.dualpipev import VIRTUAL_STAGES

TIMELINE_FORMATS = (".png", ".pdf", ".svg")


def _at_least(problems: list[str], name: str, value: Any, minimum: int | float, why: str = "") -> None:
    if value is None or value < minimum:
        problems.append(f"{name}={value!r}: must be at least {minimum}{why}")


# HybridModel's layer symbols (Megatron-Core's hybrid_layer_allocation): attention, MLA, DSA, MLP, Mamba, GDN, MoE.
_HYBRID_SYMBOLS = {"*": "attention", "+": "MLA", "D": "DSA", "-": "MLP", "M": "Mamba", "G": "GDN", "E": "MoE"}


# The package each flex backend's kernels come from (Megatron-Core imports them lazily and fails at model build).
_FLEX_PACKAGES = {"deepep": "deep_ep", "hybridep": "deep_ep", "ncclep": "transformer_engine"}


def model_impl_problems(model: Any, model_impl: str, num_layers_flag: int | None) -> list[str]:
    """What ``model_impl`` cannot build from ``model``. A good hybrid pattern then sets ``num_layers``,
    ``moe_layer_freq`` (its MoE layers) and ``mtp_num_layers`` (its depths after ``/``)."""
    flex = f"--moe_flex_dispatcher_backend={model.moe_flex_dispatcher_backend!r}"
    if model_impl == "reference":
        problems = [f"model.{problem}" for problem in model_feature_problems(model)]
        if model.moe_token_dispatcher_type == "flex":
            problems.append(
                f"{flex}: the reference model runs the alltoall dispatcher only; use --model_impl mcore (with the "
                "backend installed) or drop the flag"
            )
        return problems
    problems: list[str] = []
    package = _FLEX_PACKAGES.get(model.moe_flex_dispatcher_backend)
    if model.moe_token_dispatcher_type == "flex" and package and importlib.util.find_spec(package) is None:
        problems.append(
            f"{flex}: its package {package} is not installed here; install it (a GPU host with the backend's "
            "requirements), or drop the flag"
        )
    if model.mtp_num_layers is not None and model.mtp_num_layers < 0:
        problems.append(f"--mtp_num_layers={model.mtp_num_layers}: must be 0 or more")
    pattern = model.hybrid_layer_pattern
    if pattern is None:
        return problems
    flag = f"--hybrid_layer_pattern={pattern!r}"
    main, *depths = pattern.split("/")
    unknown = sorted(set(pattern) - set(_HYBRID_SYMBOLS) - {"/", "|"})
    if unknown:
        symbols = ", ".join(f"{symbol} {kind}" for symbol, kind in _HYBRID_SYMBOLS.items())
        problems.append(f"{flag}: unknown layer symbol(s) {''.join(unknown)!r}; use {symbols}; / before an MTP depth")
    if "|" in pattern:
        problems.append(f"{flag}: pipeline segments ('|'): the harness builds Megatron-Core models at PP 1; drop '|'")
    if "E" not in main:
        problems.append(f"{flag}: no MoE layer (E) before '/', so there is no all-to-all to overlap; add one")
    if depths and (not depths[0] or any(depth != depths[0] for depth in depths)):
        problems.append(f"{flag}: every MTP depth after '/' needs the same, non-empty pattern")
    layers = len(main.replace("|", ""))
    if num_layers_flag is not None and num_layers_flag != layers:
        problems.append(f"--num_layers={num_layers_flag}: the pattern has {layers} layers before '/'; drop the flag")
    if depths and model.mtp_num_layers not in (None, len(depths)):
        problems.append(
            f"--mtp_num_layers={model.mtp_num_layers}: the pattern has {len(depths)} MTP depth(s); drop the flag"
        )
    if importlib.util.find_spec("transformer_engine") is None:
        problems.append(
            f"{flag}: Megatron-Core ships HybridModel's layers as a Transformer Engine spec only, and Transformer "
            "Engine is not installed here; install it (the project's [te] extra, on a GPU host), or drop the pattern "
            "for a GPTModel"
        )
    if not problems:
        model.num_layers, model.moe_layer_freq = layers, [int(symbol == "E") for symbol in main]
        model.mtp_num_layers = len(depths) or model.mtp_num_layers
    return problems


def lift_model_overlap_flags(recipe: Any) -> list[str]:
    """Moves EP-overlap flags set on the model (``model.overlap_moe_expert_parallel_comm=true``) to comm_overlap.

    Both spellings then go through the same rules (``CommOverlapConfig.setup``), and each A/B arm sets the flag
    in one place. A model value that disagrees with an explicit comm_overlap value is a problem.
    """
    problems = []
    defaults = {f.name: f.default for f in dataclasses.fields(recipe.model)}
    for name in ("overlap_moe_expert_parallel_comm", "delay_wgrad_compute"):
        on_model, on_overlap = getattr(recipe.model, name), getattr(recipe.comm_overlap, name)
        if on_model == defaults[name]:
            continue
        if on_overlap is not None and on_overlap != on_model:
            problems.append(
                f"model.{name}={on_model!r} but comm_overlap.{name}={on_overlap!r}: set it in one place "
                f"(the harness's --moe_a2a_overlap/--delay_wgrad_compute, or comm_overlap.{name})"
            )
            continue
        setattr(recipe.comm_overlap, name, on_model)
        setattr(recipe.model, name, defaults[name])
    return problems


def recipe_problems(recipe: Any, schedule: str | None = None) -> list[str]:
    """Model shape, training settings and what the harness's models support (``schedule``: --pipeline_schedule)."""
    model, train = recipe.model, recipe.train
    problems: list[str] = []
    for name in (*MODEL_INT_FLAGS, "vocab_size"):
        _at_least(problems, f"model.{name}", getattr(model, name), 1)
    if not problems:
        if model.hidden_size % model.num_attention_heads:
            problems.append(
                f"model.hidden_size={model.hidden_size}: must be divisible by "
                f"num_attention_heads={model.num_attention_heads}"
            )
        if model.num_moe_experts % model.expert_model_parallel_size:
            problems.append(
                f"model.num_moe_experts={model.num_moe_experts}: must be divisible by "
                f"expert_model_parallel_size={model.expert_model_parallel_size} (experts are split evenly over EP)"
            )
        if model.moe_router_topk > model.num_moe_experts:
            problems.append(
                f"model.moe_router_topk={model.moe_router_topk}: must not exceed "
                f"num_moe_experts={model.num_moe_experts}"
            )
    problems += _layer_problems(model)
    _at_least(problems, "train.warmup_steps", train.warmup_steps, 0)
    if isinstance(train.warmup_steps, int) and train.warmup_steps >= 0:
        _at_least(
            problems,
            "--max_steps",
            train.max_steps,
            train.warmup_steps + 1,
            f" (train.warmup_steps={train.warmup_steps} warm-up step(s) are not measured; one steady step is needed)",
        )
    _at_least(problems, "--num_microbatches", train.num_microbatches, 1)
    _at_least(problems, "--micro_batch_size", train.micro_batch_size, 1)
    for name in ("collective_timeout_s", "lr"):
        value = getattr(train, name)
        if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
            problems.append(f"train.{name}={value!r}: must be a positive number")
    problems += [f"model.{problem}" for problem in router_problems(model)]
    if model.recompute_granularity == "selective" and "moe_act" in (model.recompute_modules or ()):
        if not model.moe_grouped_gemm:
            problems.append(
                "--recompute_modules moe_act: Megatron-Core's config accepts it only with moe_grouped_gemm; add "
                "model.moe_grouped_gemm=true (with Transformer Engine on a GPU that also picks its grouped GEMM)"
            )
    problems += schedule_problems(model, train, schedule) if schedule else _pipeline_problems(model, train)
    if model.cuda_graph_impl != "none":
        problems.append(
            f"--cuda_graph_impl={model.cuda_graph_impl!r}: the harness's models do not capture CUDA graphs; use none"
        )
    return problems


def _layer_problems(model: Any) -> list[str]:
    """Which layers are MoE (``moe_layer_freq``), and the biases the schedule's models do not have."""
    problems = []
    if model.add_bias_linear:
        problems.append(
            "model.add_bias_linear=True: the EP-overlap models run bias-free linears (the reference MoE GPT has "
            "none; the Megatron-Core plan refuses them); set model.add_bias_linear=false"
        )
    freq, layers = model.moe_layer_freq, model.num_layers
    if model.hybrid_layer_pattern is not None or not isinstance(layers, int) or layers < 1:
        return problems  # a pattern sets moe_layer_freq itself; a bad num_layers is reported on its own
    if isinstance(freq, bool) or not isinstance(freq, int | list):
        return problems + [f"model.moe_layer_freq={freq!r}: give an int k (every k-th layer is MoE) or a 0/1 list"]
    if isinstance(freq, int):
        if freq < 1:
            return problems + [f"model.moe_layer_freq={freq!r}: must be at least 1 (every k-th layer is MoE)"]
        return problems
    if len(freq) != layers:
        problems.append(
            f"model.moe_layer_freq={freq!r}: has {len(freq)} entries and num_layers={layers}; give one 0/1 entry "
            "per layer"
        )
    elif any(isinstance(v, bool) or v not in (0, 1) for v in freq):
        problems.append(f"model.moe_layer_freq={freq!r}: entries must be 0 (dense) or 1 (MoE)")
    elif not any(freq):
        problems.append(
            f"model.moe_layer_freq={freq!r}: no MoE layer, so there is no all-to-all to overlap; make at least one "
            "entry 1"
        )
    return problems


def _pipeline_problems(model: Any, train: Any) -> list[str]:
    """Pipeline sizes, and whether the layers split over the pipeline's chunks."""
    problems: list[str] = []
    pp, vpp = model.pipeline_model_parallel_size, model.virtual_pipeline_model_parallel_size
    _at_least(problems, "--pipeline_model_parallel_size", pp, 1)
    if vpp is not None:
        _at_least(problems, "--virtual_pipeline_model_parallel_size", vpp, 1)
    if not problems and vpp is not None and pp == 1:
        # Megatron-Core's initialize_model_parallel refuses virtual stages at PP 1, and the ranks would build one
        # chunk each, not the vpp the engine checks them against.
        problems.append(
            f"--virtual_pipeline_model_parallel_size={vpp}: virtual stages split each pipeline stage into chunks, "
            "and pipeline_model_parallel_size=1 is no pipeline; add --pipeline_model_parallel_size 2 (or more), or "
            "drop it"
        )
    if problems or not isinstance(model.num_layers, int) or model.num_layers < 1:
        return problems
    try:
        chunk_layers_of(model)
    except ValueError as exc:
        return [f"--num_layers={model.num_layers}: {exc}; change num_layers or the pipeline sizes"]
    return problems


def schedule_problems(model: Any, train: Any, schedule: str) -> list[str]:
    """What ``--pipeline_schedule`` cannot run with these pipeline sizes; DualPipeV's two stages per rank (r and
    2P-1-r) then become the model's two virtual stages, as Megatron-Core numbers the chunks' layers."""
    pp, vpp = model.pipeline_model_parallel_size, model.virtual_pipeline_model_parallel_size
    flag = "--pipeline_schedule"
    if schedule != "dualpipev":
        problems = _pipeline_problems(model, train)
        if not problems and schedule == "interleaved" and (vpp or 1) < 2:
            problems.append(
                f"{flag}=interleaved: it interleaves virtual stages, and virtual_pipeline_model_parallel_size="
                f"{vpp}; add --virtual_pipeline_model_parallel_size 2 (or more) with --pipeline_model_parallel_size 2"
            )
        if not problems and schedule == "1f1b" and (vpp or 1) > 1:
            problems.append(
                f"{flag}=1f1b: --virtual_pipeline_model_parallel_size={vpp} makes the schedule interleaved; drop "
                "one of them"
            )
        return problems
    if not isinstance(pp, int) or pp < 2:
        return [
            f"{flag}=dualpipev: DualPipeV runs 2P stages on P pipeline ranks, and pipeline_model_parallel_size={pp} "
            "is no pipeline; add --pipeline_model_parallel_size 2 (or more), or drop the flag"
        ]
    problems = []
    if vpp not in (None, VIRTUAL_STAGES):
        problems.append(
            f"--virtual_pipeline_model_parallel_size={vpp}: DualPipeV holds exactly two stages per rank (r and "
            "2P-1-r); drop the flag, or use --pipeline_schedule interleaved"
        )
    if isinstance(train.num_microbatches, int) and train.num_microbatches < 2 * pp:
        problems.append(
            f"--num_microbatches={train.num_microbatches}: DualPipeV on {pp} pipeline ranks needs at least 2 x {pp} "
            f"= {2 * pp} microbatches; raise --num_microbatches to {2 * pp}, or use --pipeline_schedule 1f1b"
        )
    layers = model.num_layers
    if isinstance(layers, int) and layers >= 1 and layers % (2 * pp):
        problems.append(
            f"--num_layers={layers}: DualPipeV splits the layers into 2 x pipeline_model_parallel_size = {2 * pp} "
            f"equal stages; use a multiple of {2 * pp} layers, or another --pipeline_schedule"
        )
    for name in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
        if getattr(model, name, None) is not None:
            problems.append(f"model.{name}={getattr(model, name)}: DualPipeV's stages are equal; unset it")
    if not problems:
        model.virtual_pipeline_model_parallel_size = VIRTUAL_STAGES
    return problems


def pipeline_dtype_auto(model: Any) -> None:
    """``pipeline_dtype`` None means auto: the activation dtype, which Megatron-Core needs set when PP > 1."""
    if (model.pipeline_model_parallel_size or 1) > 1 and model.pipeline_dtype is None:
        model.pipeline_dtype = model.activation_dtype()


def run_problems(
    args: Any, world: int, expert_parallel: int, torchrun: bool, gpus: int, pipeline: int = 1
) -> list[str]:
    """Launch settings, devices (``gpus``: CUDA devices on this host) and output paths (parent folders are created
    here)."""
    cuda = gpus > 0
    problems: list[str] = []
    _at_least(problems, "--nproc_per_node", args.nproc_per_node, 1)
    if world >= 1 and expert_parallel >= 1 and pipeline >= 1 and world % (expert_parallel * pipeline):
        held = f"expert_model_parallel_size={expert_parallel}" + (
            f" x pipeline_model_parallel_size={pipeline}" if pipeline > 1 else ""
        )
        problems.append(
            f"{world} ranks cannot hold {held}: use --nproc_per_node (or torchrun's world size) that is a multiple "
            f"of {expert_parallel * pipeline}"
        )
    if pipeline > 1 and args.predict:
        problems.append("--predict: the planner simulates PP = 1; drop --predict or the pipeline flags")
    if args.link_gbps is not None:
        if not (math.isfinite(args.link_gbps) and args.link_gbps > 0):
            problems.append(f"--link_gbps={args.link_gbps!r}: must be a positive number of Gbit/s, e.g. 0.2")
        elif torchrun:
            problems.append("--link_gbps emulates links between local ranks; under torchrun the real network is used")
    on_cuda = args.device == "cuda" or (args.device == "auto" and cuda)
    nccl = args.dist_backend == "nccl" or (args.dist_backend == "auto" and on_cuda)
    if nccl and not torchrun and cuda and args.nproc_per_node > gpus:
        problems.append(
            f"--nproc_per_node={args.nproc_per_node}: NCCL needs one GPU per rank and this host has {gpus}; use "
            "--dist_backend gloo to run them on fewer GPUs"
        )
    if args.dist_backend == "gloo" and torchrun:
        problems.append("--dist_backend gloo applies to local ranks; under torchrun the launcher's setup is used")
    if args.predict and not args.ab:
        problems.append("--predict compares the planner with a measured A/B: add --ab")
    if args.device == "cuda" and not cuda:
        problems.append("--device=cuda: no CUDA device is available on this host")
    if args.launch_off_host and (on_cuda or args.model_impl == "mcore"):
        problems.append(
            f"--launch_off_host=true: it applies to the reference model on CPU, not to "
            f"{'CUDA' if on_cuda else 'the Megatron-Core model'}; drop it (used wherever it applies) or give false"
        )
    if args.model_impl == "mcore" and not (cuda and args.device != "cpu"):
        problems.append(
            "--model_impl=mcore runs Megatron-Core layers, which need CUDA (on CPU they run only under the test "
            "fixture); use --model_impl reference, or a host with a GPU"
        )
    return problems + _outputs_problems(args)


def pipeline_run_problems(args: Any, model: Any, torchrun: bool, cuda: bool) -> list[str]:
    """What the harness's pipeline runs cannot do: the reference model runs 1F1B and interleaved in its engine; a
    Megatron-Core pipeline runs Megatron-Core's schedules (``utils/mcore_pipeline.py``), DualPipeV's over gloo."""
    schedule = args.pipeline_schedule
    pipeline = (model.pipeline_model_parallel_size or 1) > 1
    problems = []
    if schedule == "dualpipev" and args.model_impl == "reference":
        problems.append(
            "--pipeline_schedule=dualpipev: the reference model's engine runs 1F1B and interleaved pipelines, not "
            "DualPipeV; add --model_impl mcore (a Megatron-Core GPTModel)"
        )
    if not (pipeline and args.model_impl == "mcore"):
        return problems
    refused = [
        (model.hybrid_layer_pattern is not None, f"--hybrid_layer_pattern={model.hybrid_layer_pattern!r}",
         "the harness builds Megatron-Core pipeline chunks as GPTModel only",
         "drop the pattern or the pipeline flags"),
        (args.timeline is not None, f"--timeline={args.timeline!r}", "a Megatron-Core pipeline step keeps no "
         "per-op timeline", "drop it, or use --model_impl reference"),
        (args.print_schedule and schedule != "dualpipev", "--print_schedule", "it prints the engine's program, and "
         "Megatron-Core's own schedule runs this pipeline", "drop it, or use --model_impl reference"),
        (args.profile is not None, f"--profile={args.profile!r}", "a Megatron-Core pipeline run is not profiled "
         "yet", "drop it, or use --model_impl reference"),
    ]  # fmt: skip
    nccl = args.dist_backend == "nccl" or (args.dist_backend == "auto" and cuda and args.device != "cpu")
    if schedule == "dualpipev" and (nccl or (torchrun and cuda)):
        refused.append(
            (
                True,
                "--pipeline_schedule=dualpipev",
                "its P2P are tagged gloo messages (NCCL matches them by order; not built)",
                "add --dist_backend gloo (local ranks)",
            )  # fmt: skip
        )
    return problems + [f"{flag}: {why}; {fix}" for cannot, flag, why, fix in refused if cannot]


def _outputs_problems(args: Any) -> list[str]:
    """Every output path the run will write, tried now (``_output_problems``)."""
    problems = []
    for flag, path in (("--json", args.json_path), ("--timeline", args.timeline)):
        if path is not None:
            problems += _output_problems(flag, Path(path))
    if getattr(args, "profile", None) is not None:  # one trace per arm (utils/arms.py: DIR/<arm>.json)
        for arm in ("baseline", "overlap") if args.ab else ("run",):
            problems += _output_problems("--profile", Path(args.profile) / f"{arm}.json")
    if args.timeline is not None and Path(args.timeline).suffix.lower() not in TIMELINE_FORMATS:
        problems.append(f"--timeline={args.timeline!r}: use a file ending in one of {', '.join(TIMELINE_FORMATS)}")
    return problems


def _output_problems(flag: str, path: Path) -> list[str]:
    """Creates the parent folder and opens the file for writing (removing it again if it was not there), so no run
    ends unable to save its results: permission bits say nothing under /proc or /sys, an open does."""
    if path.is_dir():
        return [f"{flag}={str(path)!r}: is a folder; give a file name"]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return [f"{flag}={str(path)!r}: cannot create its folder ({exc.strerror})"]
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        return [f"{flag}={str(path)!r}: cannot be written ({exc.strerror}); choose another path"]
    if not existed:
        path.unlink(missing_ok=True)  # under torchrun every rank checks: another may have removed it already
    return []


def flag_problems(args: Any, arms: list[dict], recipe: Any) -> list[str]:
    """Flags that would change nothing for these arms: each refused, so no run reports a setting it did not use.
    Each row is (cannot act, flag, why, fix)."""
    overlapped = [arm for arm in arms if arm["overlap"]]
    delayed = [arm for arm in overlapped if arm["delay_wgrad"]]
    pipeline = (recipe.model.pipeline_model_parallel_size or 1) > 1
    given = {item.partition("=")[0].strip() for item in args.overrides}
    window = "auto" if args.attention_wgrad_window is None else args.attention_wgrad_window
    rows = [
        (
            args.ab and args.moe_a2a_overlap is False,
            f"--moe_a2a_overlap={args.moe_a2a_overlap}",
            "with --ab the baseline arm runs overlap off and the overlap arm on, whatever this flag says",
            "drop it with --ab (or drop --ab for one run with overlap off)",
        ),
        (
            args.edge_pairing and not overlapped,
            "--edge_pairing=true",
            "it pairs the overlapped schedule's warm-up and cool-down, and overlap is off",
            "add --moe_a2a_overlap true (or --ab), or drop it",
        ),
        (
            args.edge_pairing and pipeline,
            "--edge_pairing=true",
            "it applies at PP 1; with pipeline stages the per-rank pipeline schedule sets each step's pairs",
            "drop it, or drop the pipeline flags",
        ),
        (
            getattr(args, "attention_wgrad_window_given", False) and not delayed,
            f"--attention_wgrad_window={window}",
            "it places the delayed attention wgrad, and no arm delays wgrad",
            "add --delay_wgrad_compute true (with overlap), or drop it",
        ),
        (
            "model.recompute_modules" in given and recipe.model.recompute_granularity is None,
            f"model.recompute_modules={recipe.model.recompute_modules!r}",
            "with recompute_granularity=None nothing is recomputed",
            "add model.recompute_granularity=selective, or use --recompute_modules (which sets both)",
        ),
        (
            bool(args.recompute_modules) and getattr(args, "recompute_granularity", None) == "full",
            f"--recompute_modules {' '.join(args.recompute_modules or ())}",
            "it lists selective recompute's parts, and --recompute_granularity full replays whole layers",
            "drop one of them",
        ),
    ]
    return [f"{flag}: {why}; {fix}" for cannot, flag, why, fix in rows if cannot]
