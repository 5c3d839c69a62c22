"""What the EP-overlap rules read (:func:`gather_facts`), and what a rule and a violation are.

A field Megatron-Core 0.19 also takes under a deprecated name is read as Megatron-Core resolves it, under the current
name; ``SPELLED`` keeps the name the user set, which violations show.
"""

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from packaging.version import Version

from megatron.bridge.training.ep_overlap.options import EPOverlapOptions
from megatron.bridge.utils import versions

# Fact keys; the prefix says where a value comes from, and error messages print it.
OVERLAP = "comm_overlap.overlap_moe_expert_parallel_comm"
DELAY_WGRAD = "comm_overlap.delay_wgrad_compute"
OVERLAP_GRAD_REDUCE = "comm_overlap.overlap_grad_reduce"
TORCH = "installed.torch"
TE = "installed.transformer_engine"
TORCH_AT_LEAST = "check.torch_at_least"  # callable: minimum version string -> bool
TE_AT_LEAST = "check.te_at_least"
SCHEDULE = "model.ep_overlap_schedule"
CHUNKS = "ep_overlap.moe_ep_overlap_chunks"
EDGE_PAIRING = "ep_overlap.edge_pairing"
WGRAD_WINDOW = "ep_overlap.attention_wgrad_window"
OFF_HOST = "ep_overlap.launch_off_host"
MICRO_BATCH = "train.micro_batch_size"
# Model fields that Megatron-Core 0.19 also takes under a deprecated name (_DEPRECATED_SPELLINGS).
GRAPH_IMPL = "model.cuda_graph_impl"
GRAPH_MODULES = "model.cuda_graph_modules"
RECOMPUTE_MODULES = "model.recompute_modules"
# fact key -> (the deprecated field's key, its value), where the user set that one.
SPELLED = "check.spelled_as"
# False at a recipe's CommOverlapConfig.setup, before Bridge builds the model config.
MODEL_BUILT = "check.model_config_built"
MEGATRON_FSDP = "ddp.use_megatron_fsdp"

# The supported Megatron-Core line, whose TransformerConfig refuses full recompute with EP overlap.
MCORE_FULL_RECOMPUTE = "0.19"
_SCHEDULE_OPTIONS = (CHUNKS, EDGE_PAIRING, WGRAD_WINDOW, OFF_HOST)


# Model-config attributes the rules read -> the value assumed when an object lacks one.
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
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
    "moe_shared_expert_overlap": False,
    "moe_shared_expert_intermediate_size": None,
    "mtp_num_layers": None,
    "mtp_use_repeated_layer": False,
    "gradient_accumulation_fusion": False,
    "add_bias_linear": False,
    "add_qkv_bias": False,
    "overlap_dispatch_backward_with_experts_wgrad": False,
    "moe_aux_loss_coeff": 0.0,
    "moe_z_loss_coeff": None,
    "moe_expert_capacity_factor": None,
    "fp8": None,
    "fp8_recipe": "delayed",
    "fp4": None,
    "mlp_chunks_for_training": 1,
    "moe_paged_stash": False,
    "moe_flex_dispatcher_backend": None,
    "moe_expert_rank_capacity_factor": None,
    "moe_ncclep_static_shape": False,
    "moe_hybridep_pad_uneven_dispatch_inputs": False,
    "fine_grained_activation_offloading": False,
    "cpu_offloading": False,
    "ep_overlap_early_attn_memory_release": False,
    "moe_latent_size": None,
    "tensor_model_parallel_size": 1,
    "sequence_parallel": False,
    # Newer families' layer features (model_features.py); the last two are not Megatron-Core 0.19 fields.
    "experimental_attention_variant": None,
    "dsa_indexer_topk_freq": 1,
    "enable_hyper_connections": False,
    "moe_n_hash_layers": 0,
}


Text = str | Callable[[Mapping[str, Any]], str]


@dataclass(frozen=True)
class Rule:
    """One requirement of EP overlap, as data; ``message`` and ``fix`` may be functions of the facts where they name a
    field the user may have set under a deprecated name (:func:`field_set`)."""

    name: str
    fields: tuple[str, ...]
    applies: Callable[[Mapping[str, Any]], bool]
    holds: Callable[[Mapping[str, Any]], bool]
    message: Text
    fix: Text

    def violation(self, facts: Mapping[str, Any]) -> "Violation":
        spelled = facts.get(SPELLED, {})
        values = dict(spelled.get(key, (key, facts[key])) for key in self.fields)
        return Violation(self.name, values, _text(self.message, facts), _text(self.fix, facts))


def _text(text: Text, facts: Mapping[str, Any]) -> str:
    return text(facts) if callable(text) else text


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
    """Every violation of a check, one per line; an ``AssertionError`` too, as Megatron-Bridge's asserts raised."""

    def __init__(self, violations: Iterable[Violation]):
        self.violations = tuple(violations)
        count = len(self.violations)
        lines = [f"communication overlap config has {count} problem{'s' if count != 1 else ''}:"]
        lines += [f"  - {violation}" for violation in self.violations]
        super().__init__("\n".join(lines))


def graph_modules(model_config: Any) -> tuple[str, ...]:
    """Per-layer CUDA-graph module names from ``cuda_graph_modules`` and the legacy ``cuda_graph_scope``, both."""
    names: tuple[str, ...] = ()
    for raw in (getattr(model_config, "cuda_graph_modules", None), getattr(model_config, "cuda_graph_scope", None)):
        names += _module_names(raw)
    return names


def _module_names(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, str) or not isinstance(raw, Iterable):
        raw = [raw]
    return tuple(getattr(scope, "name", scope) for scope in raw)


def _graph_impl(model_config: Any) -> tuple[str, tuple[str, Any] | None]:
    """``cuda_graph_impl`` with the deprecated ``enable_cuda_graph``/``external_cuda_graph`` moved in, as 0.19 does."""
    impl = getattr(model_config, "cuda_graph_impl", "none")
    for deprecated, meant in (("enable_cuda_graph", "local"), ("external_cuda_graph", "transformer_engine")):
        if getattr(model_config, deprecated, False) and impl in ("none", meant):
            return meant, (f"model.{deprecated}", True)
    return impl, None


def _graph_modules(model_config: Any) -> tuple[tuple[str, ...], tuple[str, Any] | None]:
    """``cuda_graph_modules`` with the deprecated ``cuda_graph_scope`` moved in where unset, as 0.19 does."""
    modules, scope = getattr(model_config, "cuda_graph_modules", None), getattr(model_config, "cuda_graph_scope", None)
    if scope is not None and (not modules or modules == "full"):
        names = _module_names(scope)
        return names, ("model.cuda_graph_scope", names)
    return graph_modules(model_config), None


def _recompute_modules(model_config: Any) -> tuple[Any, tuple[str, Any] | None]:
    """``recompute_modules`` with 'moe' added by the deprecated ``moe_layer_recompute``, as 0.19 does."""
    modules = getattr(model_config, "recompute_modules", None)
    if getattr(model_config, "moe_layer_recompute", False):
        listed = list(modules or ())
        if "moe" not in listed:
            listed.append("moe")
        return listed, ("model.moe_layer_recompute", True)
    return modules, None


# Fact key -> its reader: (the value Megatron-Core will use, (the deprecated field the user set, its value) or None).
_DEPRECATED_SPELLINGS: dict[str, Callable[[Any], tuple[Any, tuple[str, Any] | None]]] = {
    GRAPH_IMPL: _graph_impl,
    GRAPH_MODULES: _graph_modules,
    RECOMPUTE_MODULES: _recompute_modules,
}


def field_set(f: Mapping[str, Any], key: str) -> str:
    """The model-config field the user set for fact ``key`` (maybe its deprecated name): what a fix must name."""
    return f[SPELLED].get(key, (key,))[0].split(".", 1)[1]


def graphs_off(f: Mapping[str, Any]) -> str:
    """The setting that turns CUDA graphs off, in the field the user turned them on with."""
    name = field_set(f, GRAPH_IMPL)
    return "cuda_graph_impl='none'" if name == "cuda_graph_impl" else f"{name}=False"


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
    model_config_built: bool = True,
    megatron_fsdp: bool = False,
) -> dict[str, Any]:
    """Collects every value the rules read into one flat mapping (arguments as :func:`check_moe_overlap`)."""
    facts: dict[str, Any] = {
        f"model.{name}": getattr(model_config, name, default) for name, default in _MODEL_FIELDS.items()
    }
    facts[SPELLED] = {}
    for key, read in _DEPRECATED_SPELLINGS.items():
        facts[key], spelled = read(model_config)
        if spelled is not None:
            facts[SPELLED][key] = spelled
    facts[SCHEDULE] = schedule_of(model_config)
    facts[OVERLAP] = bool(overlap_moe_expert_parallel_comm)
    facts[DELAY_WGRAD] = bool(delay_wgrad_compute)
    facts[OVERLAP_GRAD_REDUCE] = bool(overlap_grad_reduce)
    facts[TORCH] = versions.torch_version()
    facts[TE] = versions.te_version()
    facts[TORCH_AT_LEAST] = torch_at_least or (lambda minimum: _at_least(facts[TORCH], minimum))
    facts[TE_AT_LEAST] = te_at_least or (lambda minimum: _at_least(facts[TE], minimum))
    options = EPOverlapOptions() if options is None else options
    for key in _SCHEDULE_OPTIONS:
        facts[key] = getattr(options, key.split(".", 1)[1])
    facts[MICRO_BATCH] = micro_batch_size
    facts[MODEL_BUILT] = model_config_built
    facts[MEGATRON_FSDP] = megatron_fsdp
    return facts


def defers_mcore_checks(model_config: Any) -> bool:
    """Whether Megatron-Core's checks are still to run: a Megatron-Bridge provider defers them to ``finalize()``."""
    return callable(getattr(model_config, "finalize", None))


def use_bridge_schedule(model_config: Any) -> Any:
    """Marks ``model_config`` as run by this project's schedule, so its rules apply (call before setup); returns it."""
    model_config.ep_overlap_schedule = "bridge"
    return model_config


def schedule_of(model_config: Any) -> str:
    """Which schedule runs the layers: "bridge" if marked (:func:`use_bridge_schedule`) or hooked, else "mcore"."""
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


def overlap_on(f: Mapping[str, Any]) -> bool:
    return f[OVERLAP]


def mcore_schedule(f: Mapping[str, Any]) -> bool:
    return f[OVERLAP] and f[SCHEDULE] == "mcore"


def bridge_schedule(f: Mapping[str, Any]) -> bool:
    return f[OVERLAP] and f[SCHEDULE] != "mcore"


def full_recompute(f: Mapping[str, Any]) -> bool:
    return bridge_schedule(f) and f["model.recompute_granularity"] == "full"


def delay_wgrad_on(f: Mapping[str, Any]) -> bool:
    return f[DELAY_WGRAD]


def delay_wgrad_with_te(f: Mapping[str, Any]) -> bool:
    """Delayed wgrad with Transformer Engine installed (its grouped GEMMs run the experts; else pure torch)."""
    return f[DELAY_WGRAD] and f[TE] is not None


def te_graphs(f: Mapping[str, Any]) -> bool:
    return f[GRAPH_IMPL] == "transformer_engine"


def whole_step_graphs(f: Mapping[str, Any]) -> bool:
    """A graph of the whole step: ``local`` or ``full_iteration`` (Megatron-Core 0.19 moves that module to impl)."""
    return f[GRAPH_IMPL] in ("local", "full_iteration") or "full_iteration" in f[GRAPH_MODULES]


def host_read_in_dispatch(f: Mapping[str, Any]) -> str | None:
    """Why the token dispatch reads on the host in every step, or None for a static-shape flex backend."""
    if f["model.moe_token_dispatcher_type"] != "flex":
        return "the alltoall dispatcher copies its split sizes to the host before each all-to-all"
    backend = f["model.moe_flex_dispatcher_backend"]
    if backend == "hybridep" and f["model.moe_expert_rank_capacity_factor"] is None:
        return "HybridEP without moe_expert_rank_capacity_factor sizes its output on the host after each dispatch"
    if backend == "hybridep" and f["model.moe_hybridep_pad_uneven_dispatch_inputs"]:
        return "moe_hybridep_pad_uneven_dispatch_inputs reads the largest token count on the host"
    if backend == "ncclep" and not f["model.moe_ncclep_static_shape"]:
        return "NCCL EP without moe_ncclep_static_shape reads its received token count on the host"
    if backend not in ("hybridep", "ncclep"):
        return f"the {backend} backend waits on the host for the device's token counts in each dispatch"
    return None


def graph_scope_needs_te_wgrad(f: Mapping[str, Any]) -> bool:
    """Delayed wgrad with ``attn`` (or ``moe_router`` beside non-overlapped shared experts) listed for CUDA graphs."""
    scopes = f[GRAPH_MODULES]
    router_with_plain_shared = (
        "moe_router" in scopes
        and f["model.moe_shared_expert_intermediate_size"] is not None
        and not f["model.moe_shared_expert_overlap"]
    )
    return f[DELAY_WGRAD] and ("attn" in scopes or router_with_plain_shared)


def fp8_recipe(f: Mapping[str, Any]) -> str:
    """The fp8 recipe's name ("delayed", "tensorwise", "blockwise", "mxfp8", ...), from its enum or string."""
    recipe = f["model.fp8_recipe"]
    return str(getattr(recipe, "value", recipe))


def chunked(f: Mapping[str, Any]) -> bool:
    return f[CHUNKS] == 2


NO_TE_NOTE = (
    " (Transformer Engine grouped GEMMs only; the pure-torch grouped GEMM path has no Transformer Engine requirement.)"
)
