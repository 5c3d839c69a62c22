"""The rules a configuration must satisfy for MoE expert-parallel (EP) communication overlap.

Contract:
    * Every rule is one row of data in ``MOE_OVERLAP_RULES``: a name, the fields it reads, when it applies,
      what must hold, what is wrong when it does not, and how to fix it.
    * :func:`check_moe_overlap` evaluates every rule and returns all violations; it never raises and never
      stops at the first failure. :class:`CommOverlapConfigError` carries all of them in one message, one
      line per violation, each naming the field(s), the value(s) seen and the fix.
    * Facts are read by attribute name, so a Megatron-Core ``TransformerConfig`` or any object with the same
      attribute names works. Installed versions come from package metadata (see
      :mod:`megatron.bridge.utils.versions`) unless the caller passes its own version checks; nothing imports
      CUDA code.
    * A ``CommOverlapConfig``'s own fields (types, ranges, values set explicitly elsewhere) are checked in
      ``comm_overlap_values.py``, not here.
    * The error is both a ``ValueError`` and an ``AssertionError`` (what Megatron-Bridge's asserts raised), and
      each rule's message contains the phrase of Megatron-Bridge's assert for the same rule, so code that
      catches or matches upstream's errors keeps working.

Two rules depend on what runs the layers, not on the config alone:
    * The bf16/fp16 rule belongs to Megatron-Core's own combined-1F1B schedule (its ``TransformerConfig`` asserts
      it). This project's schedule (``ep_overlap_schedule = "bridge"`` on the model config; the reference model
      and the Megatron-Core plan set it) is bitwise-tested in fp32 too.
    * Transformer Engine version rules for delayed wgrad apply only when expert grouped GEMMs run through
      Transformer Engine. Our pure-torch grouped GEMM has no Transformer Engine requirement.
"""

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from packaging.version import Version

from megatron.bridge.utils import versions

# Keys of the facts mapping. Prefixes say where a value comes from, and are what error messages print.
OVERLAP = "comm_overlap.overlap_moe_expert_parallel_comm"
DELAY_WGRAD = "comm_overlap.delay_wgrad_compute"
OVERLAP_GRAD_REDUCE = "comm_overlap.overlap_grad_reduce"
TORCH = "installed.torch"
TE = "installed.transformer_engine"
TORCH_AT_LEAST = "check.torch_at_least"  # callable: minimum version string -> bool
TE_AT_LEAST = "check.te_at_least"
GROUPED_GEMM = "expert_grouped_gemm_backend"
SCHEDULE = "model.ep_overlap_schedule"
# This project's schedule options (an ``EPOverlapOptions``), and what a launcher knows of its data.
CHUNKS = "ep_overlap.moe_ep_overlap_chunks"
EDGE_PAIRING = "ep_overlap.edge_pairing"
WGRAD_WINDOW = "ep_overlap.attention_wgrad_window"
OFF_HOST = "ep_overlap.launch_off_host"
MICRO_BATCH = "train.micro_batch_size"
# Where Megatron-Core's own overlapped schedule stands on full recompute: what would allow it.
MCORE_FULL_RECOMPUTE = "0.19; its dev line replays it (PRs #5869, #6311), main's PR #6429 is still open"
_SCHEDULE_DEFAULTS = {CHUNKS: 1, EDGE_PAIRING: False, WGRAD_WINDOW: 1, OFF_HOST: None}

TE_GROUPED_GEMM = "transformer_engine"
TORCH_GROUPED_GEMM = "torch"

# Model-config attributes the rules read, with the value assumed when an object lacks the attribute.
_MODEL_FIELDS: dict[str, Any] = {
    "expert_model_parallel_size": 1,
    "num_moe_experts": None,
    "moe_token_dispatcher_type": "allgather",
    "bf16": False,
    "fp16": False,
    "pipeline_model_parallel_size": 1,
    "virtual_pipeline_model_parallel_size": None,
    "recompute_granularity": None,
    "recompute_method": None,
    "recompute_num_layers": None,
    "recompute_modules": None,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
    "moe_shared_expert_overlap": False,
    "moe_shared_expert_intermediate_size": None,
    "mtp_num_layers": None,
    "cuda_graph_impl": "none",
    "gradient_accumulation_fusion": False,
    "add_bias_linear": False,
    "add_qkv_bias": False,
    "overlap_dispatch_backward_with_experts_wgrad": False,
    "moe_aux_loss_coeff": 0.0,
    "moe_z_loss_coeff": None,
    "moe_expert_capacity_factor": None,
}


@dataclass(frozen=True)
class Rule:
    """One requirement of EP overlap, as data.

    Attributes:
        name: Short identifier, printed in brackets.
        fields: Fact keys whose values the message shows.
        applies: True when the rule is relevant for these facts (e.g. only with delayed wgrad on).
        holds: True when the requirement is met.
        message: What is wrong, in one sentence.
        fix: What to change, in one sentence.
    """

    name: str
    fields: tuple[str, ...]
    applies: Callable[[Mapping[str, Any]], bool]
    holds: Callable[[Mapping[str, Any]], bool]
    message: str
    fix: str


@dataclass(frozen=True)
class Violation:
    """A failed rule (or a model/comm_overlap disagreement) with the values seen."""

    name: str
    values: dict[str, Any]
    message: str
    fix: str

    def __str__(self) -> str:
        seen = ", ".join(f"{key}={_show(value)}" for key, value in self.values.items())
        return f"[{self.name}] {seen}: {self.message} Fix: {self.fix}"


def _show(value: Any) -> str:
    return str(value) if isinstance(value, Version) else repr(value)


class CommOverlapConfigError(ValueError, AssertionError):
    """Raised once with every violated rule listed, one per line.

    An ``AssertionError`` too: Megatron-Bridge raised that for the same rules, and callers catch it.
    """

    def __init__(self, violations: Iterable[Violation]):
        self.violations = tuple(violations)
        count = len(self.violations)
        lines = [f"communication overlap config has {count} problem{'s' if count != 1 else ''}:"]
        lines += [f"  - {violation}" for violation in self.violations]
        super().__init__("\n".join(lines))


def graph_modules(model_config: Any) -> tuple[str, ...]:
    """Per-layer CUDA-graph modules as plain names, from ``cuda_graph_modules`` and the legacy ``cuda_graph_scope``.

    Megatron-Core 0.19 renamed the field; older Bridge configs still set the old one, so both count.
    """
    names: list[str] = []
    for raw in (getattr(model_config, "cuda_graph_modules", None), getattr(model_config, "cuda_graph_scope", None)):
        if raw is None:
            continue
        if isinstance(raw, str) or not isinstance(raw, Iterable):
            raw = [raw]
        names += [getattr(scope, "name", scope) for scope in raw]
    return tuple(names)


def grouped_gemm_backend(te_version: Version | None) -> str:
    """Which backend runs expert grouped GEMMs: Transformer Engine when installed, else pure torch."""
    return TE_GROUPED_GEMM if te_version is not None else TORCH_GROUPED_GEMM


def gather_facts(
    model_config: Any,
    *,
    overlap_moe_expert_parallel_comm: bool,
    delay_wgrad_compute: bool,
    overlap_grad_reduce: bool = False,
    torch_at_least: Callable[[str], bool] | None = None,
    te_at_least: Callable[[str], bool] | None = None,
    options: Any = None,
    micro_batch_size: int | None = None,
) -> dict[str, Any]:
    """Collects every value the rules read into one flat mapping keyed by where it comes from.

    ``torch_at_least``/``te_at_least`` (minimum version -> bool) default to the installed versions. ``options``
    (an ``EPOverlapOptions``, read by attribute) adds the schedule's options; ``micro_batch_size`` what a launcher
    knows of the data.
    """
    facts: dict[str, Any] = {
        f"model.{name}": getattr(model_config, name, default) for name, default in _MODEL_FIELDS.items()
    }
    facts["model.cuda_graph_scope"] = graph_modules(model_config)
    facts[SCHEDULE] = schedule_of(model_config)
    facts[OVERLAP] = bool(overlap_moe_expert_parallel_comm)
    facts[DELAY_WGRAD] = bool(delay_wgrad_compute)
    facts[OVERLAP_GRAD_REDUCE] = bool(overlap_grad_reduce)
    facts[TORCH] = versions.torch_version()
    facts[TE] = versions.te_version()
    facts[GROUPED_GEMM] = grouped_gemm_backend(facts[TE])
    facts[TORCH_AT_LEAST] = torch_at_least or (lambda minimum: _at_least(facts[TORCH], minimum))
    facts[TE_AT_LEAST] = te_at_least or (lambda minimum: _at_least(facts[TE], minimum))
    for key, default in _SCHEDULE_DEFAULTS.items():
        facts[key] = getattr(options, key.split(".", 1)[1], default)
    facts[MICRO_BATCH] = micro_batch_size
    return facts


def use_bridge_schedule(model_config: Any) -> Any:
    """Marks ``model_config`` as run by this project's schedule (``EPOverlapEngine``, ``use_ep_overlap_schedule``),
    whose rules apply instead of Megatron-Core's own overlapped schedule's (fp32 is tested bitwise there). The
    Megatron-Core plan marks the config itself when it is built; a recipe whose ``setup`` runs before that calls
    this first. Returns the config."""
    model_config.ep_overlap_schedule = "bridge"
    return model_config


def schedule_of(model_config: Any) -> str:
    """Which schedule runs the layers: "bridge" (this project's) where the config is marked
    (:func:`use_bridge_schedule`) or a Megatron-Bridge recipe registered the hook that installs it
    (``cfg.model.register_pre_wrap_hook``, the hook itself or a ``functools.partial`` of it); else "mcore"."""
    if getattr(model_config, "ep_overlap_schedule", "mcore") == "bridge":
        return "bridge"
    for hook in getattr(model_config, "_pre_wrap_hooks", None) or ():
        while isinstance(hook, functools.partial):
            hook = hook.func
        if getattr(hook, "runs_bridge_schedule", False):
            return "bridge"
    return "mcore"


def _at_least(version: Version | None, minimum: str) -> bool:
    return version is not None and version >= Version(minimum)


def _overlap_on(f: Mapping[str, Any]) -> bool:
    return f[OVERLAP]


def _mcore_schedule(f: Mapping[str, Any]) -> bool:
    return f[OVERLAP] and f[SCHEDULE] == "mcore"


def _bridge_schedule(f: Mapping[str, Any]) -> bool:
    return f[OVERLAP] and f[SCHEDULE] != "mcore"


def _full_recompute(f: Mapping[str, Any]) -> bool:
    return _bridge_schedule(f) and f["model.recompute_granularity"] == "full"


def _delay_on(f: Mapping[str, Any]) -> bool:
    return f[DELAY_WGRAD]


def _delay_with_te(f: Mapping[str, Any]) -> bool:
    return f[DELAY_WGRAD] and f[GROUPED_GEMM] == TE_GROUPED_GEMM


def _te_graphs(f: Mapping[str, Any]) -> bool:
    return f["model.cuda_graph_impl"] == "transformer_engine"


def _graph_scope_needs_te_wgrad(f: Mapping[str, Any]) -> bool:
    """CUDA-graphed attention (or a graphed router whose shared experts are not overlapped) with delayed wgrad.

    Judged by the graph modules alone, as Megatron-Bridge does: recipes set ``cuda_graph_impl`` separately, and
    a module listed for capture is taken as a request to capture it.
    """
    scopes = f["model.cuda_graph_scope"]
    router_with_plain_shared = (
        "moe_router" in scopes
        and f["model.moe_shared_expert_intermediate_size"] is not None
        and not f["model.moe_shared_expert_overlap"]
    )
    return f[DELAY_WGRAD] and ("attn" in scopes or router_with_plain_shared)


def _chunked(f: Mapping[str, Any]) -> bool:
    return f[CHUNKS] == 2


_NO_TE_NOTE = (
    " (Transformer Engine grouped GEMMs only; the pure-torch grouped GEMM path has no Transformer Engine requirement.)"
)

MOE_OVERLAP_RULES: tuple[Rule, ...] = (
    # --- overlap_moe_expert_parallel_comm ---
    Rule(
        "expert_parallel",
        ("model.expert_model_parallel_size",),
        _overlap_on,
        lambda f: (f["model.expert_model_parallel_size"] or 1) > 1,
        "EP overlap is only supported when expert_model_parallel_size > 1: it hides the expert-parallel all-to-all.",
        "set expert_model_parallel_size > 1, or turn overlap_moe_expert_parallel_comm off.",
    ),
    Rule(
        "moe_experts",
        ("model.num_moe_experts",),
        _overlap_on,
        lambda f: (f["model.num_moe_experts"] or 0) > 1,
        "EP overlap is only supported when num_moe_experts > 1.",
        "set num_moe_experts > 1, or turn overlap_moe_expert_parallel_comm off for a dense model.",
    ),
    Rule(
        "token_dispatcher",
        ("model.moe_token_dispatcher_type",),
        _overlap_on,
        lambda f: f["model.moe_token_dispatcher_type"] in ("alltoall", "flex"),
        "EP overlap is only supported when moe_token_dispatcher_type == 'alltoall' or 'flex'.",
        "set moe_token_dispatcher_type='alltoall', or call apply_flex_dispatcher_backend(model, 'deepep'|'hybridep').",
    ),
    Rule(
        "precision",
        ("model.bf16", "model.fp16", SCHEDULE),
        lambda f: f[OVERLAP] and f[SCHEDULE] == "mcore",
        lambda f: bool(f["model.bf16"] or f["model.fp16"]),
        "Megatron-Core's own overlapped schedule is only supported when using bf16 or fp16 models.",
        "set bf16=True (or fp16=True); where this project's schedule runs the layers (EPOverlapEngine or "
        "use_ep_overlap_schedule), say so first: register the hook (cfg.model.register_pre_wrap_hook) or call "
        "use_bridge_schedule() on the model config, before setup.",
    ),
    Rule(
        "torch_version",
        (TORCH,),
        _overlap_on,
        lambda f: f[TORCH_AT_LEAST]("2.6.0"),
        "EP overlap (A2A overlap) has a known hang issue with torch version < 2.6.0.",
        "upgrade PyTorch to >= 2.6.0.",
    ),
    Rule(
        "pipeline_needs_vpp",
        ("model.pipeline_model_parallel_size", "model.virtual_pipeline_model_parallel_size"),
        lambda f: f[OVERLAP] and (f["model.pipeline_model_parallel_size"] or 1) > 1,
        lambda f: f["model.virtual_pipeline_model_parallel_size"] is not None,
        "virtual_pipeline_model_parallel_size must be specified when pipeline_model_parallel_size > 1: EP overlap "
        "pairs microbatches across virtual stages.",
        "set virtual_pipeline_model_parallel_size (e.g. 2), or pipeline_model_parallel_size=1.",
    ),
    Rule(
        "no_full_recompute",
        ("model.recompute_granularity", SCHEDULE),
        _mcore_schedule,
        lambda f: f["model.recompute_granularity"] != "full",
        "full recompute re-runs whole layers and breaks the paired layer schedule: disable full recomputation. "
        f"Megatron-Core's own overlapped schedule refuses it up to its latest release ({MCORE_FULL_RECOMPUTE}); "
        "this project's schedule replays it.",
        "set recompute_granularity=None (or 'selective' without 'moe'), or run this project's schedule "
        "(EPOverlapEngine with the reference MoE GPT).",
    ),
    Rule(
        "no_recompute_method",
        ("model.recompute_method", SCHEDULE),
        _mcore_schedule,
        lambda f: f["model.recompute_method"] is None,
        "a recompute method implies layer recompute, which EP overlap does not support: disable recomputation method.",
        "set recompute_method=None.",
    ),
    Rule(
        "no_recompute_num_layers",
        ("model.recompute_num_layers", SCHEDULE),
        _mcore_schedule,
        lambda f: f["model.recompute_num_layers"] is None,
        "recompute_num_layers must be None with EP overlap: it implies layer recompute.",
        "set recompute_num_layers=None.",
    ),
    # This project's schedule replays full recompute's segments (ep_overlap/segments.py).
    Rule(
        "recompute_layers_need_full",
        ("model.recompute_granularity", "model.recompute_method", "model.recompute_num_layers"),
        lambda f: _bridge_schedule(f) and f["model.recompute_granularity"] != "full",
        lambda f: f["model.recompute_method"] is None and f["model.recompute_num_layers"] is None,
        "recompute_method and recompute_num_layers choose the layers of full recompute, which is not asked for.",
        "set recompute_granularity='full', or recompute_method=None and recompute_num_layers=None.",
    ),
    Rule(
        "full_recompute_method",
        ("model.recompute_method",),
        _full_recompute,
        lambda f: f["model.recompute_method"] in ("uniform", "block"),
        "full recompute replays segments of recompute_num_layers layers ('uniform') or the first "
        "recompute_num_layers layers ('block').",
        "set recompute_method='uniform' (or 'block').",
    ),
    Rule(
        "full_recompute_num_layers",
        ("model.recompute_num_layers",),
        _full_recompute,
        lambda f: type(f["model.recompute_num_layers"]) is int and f["model.recompute_num_layers"] >= 1,
        "full recompute needs the number of layers per segment ('uniform') or recomputed ('block').",
        "set a positive integer, e.g. recompute_num_layers=1.",
    ),
    Rule(
        "full_recompute_dropout",
        ("model.hidden_dropout", "model.attention_dropout"),
        _full_recompute,
        lambda f: not f["model.hidden_dropout"] and not f["model.attention_dropout"],
        "the replay of full recompute does not restore the RNG state, so dropout would draw other masks than the "
        "first forward and change the gradients.",
        "set hidden_dropout=0.0 and attention_dropout=0.0.",
    ),
    Rule(
        "no_moe_recompute",
        ("model.recompute_modules", SCHEDULE),
        lambda f: f[OVERLAP] and f[SCHEDULE] == "mcore",
        lambda f: "moe" not in (f["model.recompute_modules"] or ()),
        "recomputing the MoE module conflicts with the split MoE layer nodes: disable moe in recompute_modules.",
        "remove 'moe' from recompute_modules.",
    ),
    Rule(
        "no_shared_expert_overlap",
        ("model.moe_shared_expert_overlap",),
        _overlap_on,
        lambda f: not f["model.moe_shared_expert_overlap"],
        "moe_shared_expert_overlap schedules shared experts on its own and conflicts with EP overlap: disable "
        "moe_shared_expert_overlap.",
        "set moe_shared_expert_overlap=False (EP overlap already hides the all-to-all).",
    ),
    Rule(
        "mtp_layers",
        ("model.mtp_num_layers",),
        _overlap_on,
        lambda f: f["model.mtp_num_layers"] in (None, 0, 1),
        "with EP overlap, MTP supports at most one layer (mtp_num_layers).",
        "set mtp_num_layers to None, 0 or 1.",
    ),
    Rule(
        "cuda_graph_scope",
        ("model.cuda_graph_impl", "model.cuda_graph_scope"),
        lambda f: f[OVERLAP] and _te_graphs(f),
        lambda f: not {"moe", "mlp"} & set(f["model.cuda_graph_scope"]),
        "Transformer Engine CUDA graphs over 'moe' or 'mlp' would capture the all-to-all the schedule splits.",
        "drop 'moe' and 'mlp' from cuda_graph_scope (e.g. keep 'attn', 'moe_router', 'moe_preprocess').",
    ),
    Rule(
        "no_dispatch_wgrad_overlap",
        ("model.overlap_dispatch_backward_with_experts_wgrad",),
        _overlap_on,
        lambda f: not f["model.overlap_dispatch_backward_with_experts_wgrad"],
        "overlap_dispatch_backward_with_experts_wgrad is a separate, non-paired schedule.",
        "set overlap_dispatch_backward_with_experts_wgrad=False (delay_wgrad_compute gives that overlap here).",
    ),
    # --- delay_wgrad_compute ---
    Rule(
        "delay_wgrad_needs_overlap",
        (DELAY_WGRAD, OVERLAP),
        _delay_on,
        lambda f: f[OVERLAP],
        "overlap_moe_expert_parallel_comm is required for delay_wgrad_compute: the EP overlap layer step schedules "
        "the delayed wgrad.",
        "set comm_overlap.overlap_moe_expert_parallel_comm=True, or delay_wgrad_compute=False.",
    ),
    Rule(
        "delay_wgrad_grad_reduce_te",
        (OVERLAP_GRAD_REDUCE, TE),
        lambda f: _delay_with_te(f) and f[OVERLAP_GRAD_REDUCE],
        lambda f: f[TE_AT_LEAST]("2.7.0"),
        "TE version >= 2.7.0 is required for overlap_grad_reduce when using delay_wgrad_compute" + _NO_TE_NOTE,
        "upgrade transformer-engine to >= 2.7.0, or set overlap_grad_reduce=False.",
    ),
    Rule(
        "delay_wgrad_grad_fusion_te",
        ("model.gradient_accumulation_fusion", TE),
        lambda f: _delay_with_te(f) and f["model.gradient_accumulation_fusion"],
        lambda f: f[TE_AT_LEAST]("2.7.0"),
        "TE version >= 2.7.0 is required for gradient_accumulation_fusion when using delay_wgrad_compute"
        + _NO_TE_NOTE,
        "upgrade transformer-engine to >= 2.7.0, or set gradient_accumulation_fusion=False.",
    ),
    Rule(
        "delay_wgrad_graph_te",
        ("model.cuda_graph_scope", TE),
        lambda f: _graph_scope_needs_te_wgrad(f) and f[GROUPED_GEMM] == TE_GROUPED_GEMM,
        lambda f: f[TE_AT_LEAST]("2.12.0"),
        "CUDA graph with delay_wgrad_compute requires TE version >= 2.12.0 (graphed attention, or a graphed router "
        "with non-overlapped shared experts)" + _NO_TE_NOTE,
        "upgrade transformer-engine to >= 2.12.0, or drop 'attn'/'moe_router' from cuda_graph_scope.",
    ),
    Rule(
        "delay_wgrad_graph_grad_fusion",
        ("model.cuda_graph_scope", "model.gradient_accumulation_fusion"),
        _graph_scope_needs_te_wgrad,
        lambda f: bool(f["model.gradient_accumulation_fusion"]),
        "CUDA graph with delay_wgrad_compute requires gradient_accumulation_fusion: graphed wgrad needs the static "
        "main_grad buffers.",
        "set gradient_accumulation_fusion=True, or drop 'attn'/'moe_router' from cuda_graph_scope.",
    ),
    Rule(
        "delay_wgrad_graph_attn_bias",
        ("model.cuda_graph_scope", "model.add_bias_linear", "model.add_qkv_bias"),
        _graph_scope_needs_te_wgrad,
        lambda f: not (f["model.add_bias_linear"] or f["model.add_qkv_bias"]),
        "CUDA graph with delay_wgrad_compute does not support attention bias.",
        "set add_bias_linear=False and add_qkv_bias=False, or drop 'attn'/'moe_router' from cuda_graph_scope.",
    ),
    # --- this project's schedule options (EPOverlapOptions) ---
    Rule(
        "attention_wgrad_window",
        (WGRAD_WINDOW,),
        lambda f: True,
        lambda f: f[WGRAD_WINDOW] in (1, 2, None),
        "the delayed attention wgrad goes to window 1 (beside B.combine backward) or 2 (beside F.dispatch).",
        "set attention_wgrad_window to 1, 2, or None (auto: the planner chooses).",
    ),
    Rule(
        "full_recompute_wgrad_window",
        (WGRAD_WINDOW, "model.recompute_method"),
        lambda f: _full_recompute(f) and f["model.recompute_method"] == "uniform",
        lambda f: f[WGRAD_WINDOW] != 2,
        "with every layer replayed (full recompute, 'uniform'), each layer step runs B's delayed attention wgrad "
        "beside its combine backward (window 1's place); window 2 would change nothing.",
        "set attention_wgrad_window=1 (or None).",
    ),
    Rule(
        "attention_wgrad_auto_pp1",
        (WGRAD_WINDOW, "model.pipeline_model_parallel_size"),
        lambda f: f[WGRAD_WINDOW] is None,
        lambda f: (f["model.pipeline_model_parallel_size"] or 1) == 1,
        "attention_wgrad_window=None (auto) needs PP = 1: the planner that chooses simulates PP = 1.",
        "set attention_wgrad_window to 1 or 2 with pipeline parallelism.",
    ),
    Rule(
        "launch_off_host_needs_overlap",
        (OFF_HOST, OVERLAP),
        lambda f: f[OFF_HOST] is True,
        lambda f: f[OVERLAP],
        "launch_off_host launches the overlapped schedule's all-to-alls, and overlap is off.",
        "leave launch_off_host None (where it applies) or False, or turn overlap on.",
    ),
    Rule(
        "chunks_choice",
        (CHUNKS,),
        lambda f: True,
        lambda f: f[CHUNKS] in (1, 2),
        "moe_ep_overlap_chunks must be 1 (off) or 2 (split each microbatch that would run alone in two).",
        "set moe_ep_overlap_chunks to 1 or 2.",
    ),
    Rule(
        "chunks_need_overlap",
        (CHUNKS, OVERLAP),
        _chunked,
        lambda f: f[OVERLAP],
        "chunking splits the phases the EP-overlap schedule leaves unpaired, so it needs that schedule.",
        "turn on overlap_moe_expert_parallel_comm, or set moe_ep_overlap_chunks=1.",
    ),
    Rule(
        "chunks_pp1",
        (CHUNKS, "model.pipeline_model_parallel_size"),
        _chunked,
        lambda f: (f["model.pipeline_model_parallel_size"] or 1) == 1,
        "chunked unpaired phases are built for PP = 1 only.",
        "set moe_ep_overlap_chunks=1 with pipeline parallelism.",
    ),
    Rule(
        "chunks_or_edge_pairing",
        (CHUNKS, EDGE_PAIRING),
        _chunked,
        lambda f: not f[EDGE_PAIRING],
        "edge pairing and chunking both pair the step's ends; they cannot both be on.",
        "choose one: edge_pairing=False or moe_ep_overlap_chunks=1.",
    ),
    Rule(
        "chunks_aux_loss",
        (CHUNKS, "model.moe_aux_loss_coeff"),
        _chunked,
        lambda f: not (f["model.moe_aux_loss_coeff"] or 0.0) > 0,
        "a load-balancing loss over half a microbatch is a different loss than over the whole one.",
        "set moe_aux_loss_coeff=0, or moe_ep_overlap_chunks=1.",
    ),
    Rule(
        "chunks_z_loss",
        (CHUNKS, "model.moe_z_loss_coeff"),
        _chunked,
        lambda f: not (f["model.moe_z_loss_coeff"] or 0.0) > 0,
        "the router z-loss is a mean over the microbatch's tokens; over half of them it is a different loss.",
        "unset moe_z_loss_coeff, or set moe_ep_overlap_chunks=1.",
    ),
    Rule(
        "chunks_capacity",
        (CHUNKS, "model.moe_expert_capacity_factor"),
        _chunked,
        lambda f: f["model.moe_expert_capacity_factor"] is None,
        "which tokens a capacity drops depends on the whole microbatch.",
        "unset moe_expert_capacity_factor (no token dropping), or set moe_ep_overlap_chunks=1.",
    ),
    Rule(
        "chunks_micro_batch",
        (CHUNKS, MICRO_BATCH),
        lambda f: _chunked(f) and f[MICRO_BATCH] is not None,
        lambda f: f[MICRO_BATCH] >= 2,
        "chunks split a microbatch along its sequences, so it needs at least 2.",
        "set micro_batch_size >= 2 (e.g. 2 sequences of half the length keep the tokens per microbatch), or "
        "moe_ep_overlap_chunks=1.",
    ),
)


def check_moe_overlap(
    model_config: Any,
    *,
    overlap_moe_expert_parallel_comm: bool,
    delay_wgrad_compute: bool,
    overlap_grad_reduce: bool = False,
    torch_at_least: Callable[[str], bool] | None = None,
    te_at_least: Callable[[str], bool] | None = None,
    rules: Iterable[Rule] = MOE_OVERLAP_RULES,
    options: Any = None,
    micro_batch_size: int | None = None,
) -> list[Violation]:
    """Evaluates every rule and returns all violations (empty when the config is fine). Never raises.

    Args:
        model_config: Model config read by attribute name (e.g. a ``TransformerConfig``).
        overlap_moe_expert_parallel_comm: Resolved EP-overlap flag.
        delay_wgrad_compute: Resolved delayed-wgrad flag.
        overlap_grad_reduce: Resolved data-parallel grad-reduce overlap flag.
        torch_at_least: Minimum-version check for PyTorch (default: the installed version).
        te_at_least: Minimum-version check for Transformer Engine (default: the installed version).
        rules: The rule table; defaults to ``MOE_OVERLAP_RULES``.
        options: This project's schedule options (``EPOverlapOptions``); None: their defaults.
        micro_batch_size: Sequences per microbatch, when a launcher knows it.
    """
    facts = gather_facts(
        model_config,
        overlap_moe_expert_parallel_comm=overlap_moe_expert_parallel_comm,
        delay_wgrad_compute=delay_wgrad_compute,
        overlap_grad_reduce=overlap_grad_reduce,
        torch_at_least=torch_at_least,
        te_at_least=te_at_least,
        options=options,
        micro_batch_size=micro_batch_size,
    )
    return [
        Violation(rule.name, {key: facts[key] for key in rule.fields}, rule.message, rule.fix)
        for rule in rules
        if rule.applies(facts) and not rule.holds(facts)
    ]


def check_ep_overlap_options(
    model_config: Any, options: Any, *, micro_batch_size: int | None = None
) -> list[Violation]:
    """Every rule for running this project's schedule with ``options`` (an ``EPOverlapOptions``) on ``model_config``:
    what the engine, the harness and the Megatron-Core hook check, with the same lines."""
    return check_moe_overlap(
        model_config,
        overlap_moe_expert_parallel_comm=options.overlap,
        delay_wgrad_compute=options.delay_wgrad,
        options=options,
        micro_batch_size=micro_batch_size,
    )
