"""What the Megatron-Core plan refuses, each with one line naming the fix.

:func:`config_refusals` gives what a config alone decides, for a recipe check beside the rules; it repeats no rule.
``refuse_*`` raise at build.
"""

import logging

import torch

from megatron.bridge.utils.logging import warn_rank0

logger = logging.getLogger(__name__)

_OFF = "or turn overlap_moe_expert_parallel_comm off for this model"
# Bridge's providers of its Qwen3VLModel, recognized by class name: Bridge's models are not imported here.
_QWEN3_VL_PROVIDERS = frozenset(
    {"Qwen3VLModelProvider", "Qwen3VLMoEModelProvider", "Qwen35VLModelProvider", "Qwen35VLMoEModelProvider"}
)


def config_refusals(config) -> list[tuple[str, str]]:
    """``(name, line)`` per refusal that ``config`` (a Bridge provider or a ``TransformerConfig``) decides."""
    classes = {cls.__name__ for cls in type(config).__mro__}
    vision_language = bool(classes & _QWEN3_VL_PROVIDERS)
    refusals = []
    if not vision_language and callable(getattr(config, "provide_language_model", None)):
        refusals.append(("model_class", _model_class_line(type(config).__name__)))
    kind = getattr(config, "position_embedding_type", None)
    refusals += _language_refusals(config, kind, multimodal_rotary=vision_language)
    if vision_language:
        refusals += _vision_language_refusals(config)
    zero_copy = zero_copy_refusal(config)
    if zero_copy is not None:
        refusals.append(("ncclep_zero_copy", zero_copy))
    # A hybrid stack's MoE layers have no attention of their own for an 'attn' graph to cover.
    hybrid = any(getattr(config, name, None) for name in ("hybrid_layer_pattern", "hybrid_override_pattern"))
    graphed = moe_recompute_graph_refusal(config, has_attention=not hybrid)
    if graphed is not None:
        refusals.append(("moe_recompute_graphs", graphed))
    return refusals


def moe_recompute_graph_refusal(config, *, has_attention: bool) -> str | None:
    """The line refusing 'moe' recompute where a Transformer Engine graph of the MoE layer ends inside the MoE part
    the plan replays (each such layer raises it, its name first), or None."""
    modules = getattr(config, "recompute_modules", None) or ()
    moe = getattr(config, "recompute_granularity", None) == "selective" and "moe" in modules
    if not moe or getattr(config, "cuda_graph_impl", "none") != "transformer_engine":
        return None
    scopes = {getattr(scope, "name", scope) for scope in getattr(config, "cuda_graph_modules", None) or ()}
    graphed = sorted(scopes & ({"moe_router", "moe_preprocess"} | ({"attn"} if has_attention else set())))
    if not graphed:
        return None
    return (
        f"recompute_modules with 'moe' and cuda_graph_modules {graphed}: the graph of each MoE layer ends inside the "
        "MoE part that the plan replays in backward; fix: drop 'moe' from recompute_modules, or those scopes from "
        f"cuda_graph_modules, {_OFF}"
    )


def _model_class_line(provider: str) -> str:
    return (
        f"{provider} builds a model of its own around its language model (provide_language_model): the EP-overlap "
        "plan runs Megatron-Core's GPTModel and HybridModel and Megatron-Bridge's Qwen3VLModel, no other model class "
        "yet (supporting one takes a plan of what its forward runs besides the language model's layers, such as a "
        "vision tower whose features it merges before the first layer); fix: train its language model alone (a text "
        f"provider, e.g. its to_text_provider() where it has one), {_OFF}"
    )


def zero_copy_refusal(config) -> str | None:
    """The line refusing NCCL EP's zero-copy buffers (each MoE layer raises it, its name first), or None."""
    ncclep = (
        getattr(config, "moe_token_dispatcher_type", None) == "flex"
        and getattr(config, "moe_flex_dispatcher_backend", None) == "ncclep"
    )
    if not (ncclep and getattr(config, "moe_ncclep_zero_copy", False)):
        return None
    return (
        "moe_ncclep_zero_copy=True: NCCL EP's experts write into one receive buffer shared by every microbatch, and "
        "the EP-overlap schedule keeps two microbatches' tokens in flight; fix: set moe_ncclep_zero_copy=False, "
        f"{_OFF}"
    )


def _language_refusals(config, position_embedding_type, *, multimodal_rotary: bool) -> list[tuple[str, str]]:
    refusals = []  # any number of MTP layers: the head runs Megatron-Core's MTP block, every depth in turn
    standalone = _standalone_mtp_stage(config)
    if standalone is not None:
        refusals.append(
            (
                "mtp_standalone_stage",
                "pipeline_model_parallel_layout puts the multi-token prediction layer on pipeline stage "
                f"{standalone}, apart from the loss (Megatron-Core's standalone MTP stage): the EP-overlap plan runs "
                "the MTP layer in the head of the stage that computes the loss; fix: list 'mtp' in the last stage, "
                f"before 'loss', {_OFF}",
            )
        )
    if position_embedding_type == "mrope" and not multimodal_rotary:
        refusals.append(
            (
                "mrope",
                "position_embedding_type='mrope': multimodal rotary positions (3 position ids per token) are not "
                "scheduled by the EP-overlap plan outside Megatron-Bridge's Qwen3VLModel, which computes them from a "
                "microbatch's input ids and image grids; fix: build the language model inside that model, or use "
                f"'rope' or 'learned_absolute', {_OFF}",
            )
        )
    return refusals


def refuse_unscheduled(model: torch.nn.Module, mtp: bool, *, multimodal_rotary: bool = False) -> None:
    """Raises ValueError (one line, with its fix) for the first model feature the plan does not schedule."""
    config = model.config
    decided = _language_refusals(config, model.position_embedding_type, multimodal_rotary=multimodal_rotary)
    if decided:
        raise ValueError(decided[0][1])
    if mtp and config.recompute_granularity == "full" and config.recompute_method == "uniform":
        if config.recompute_num_layers != 1:  # Megatron-Core's MTP layer asserts it in its first forward
            raise ValueError(
                f"recompute_num_layers={config.recompute_num_layers} with recompute_method='uniform' and an MTP "
                "layer: Megatron-Core checkpoints the MTP depth as one segment only with recompute_num_layers=1; "
                f"fix: set recompute_num_layers=1 (or recompute_method='block'), {_OFF}"
            )
    local = _local_attention_layers(model) if config.context_parallel_size > 1 else []
    if local:
        raise ValueError(
            f"context_parallel_size={config.context_parallel_size}: layers {local} use Megatron-Core's local "
            "DotProductAttention, which attends only within this rank's part of the sequence (it takes no context "
            "parallelism); fix: build the layers with Transformer Engine's attention (a TE layer spec), or set "
            f"context_parallel_size=1, {_OFF}"
        )


def _vision_language_refusals(config) -> list[tuple[str, str]]:
    # Sequence and context parallelism run: the plan splits the merged embeddings, deepstack features, positions,
    # labels and loss mask as the model does, and runs the vision tower on this CP rank's images (vision_dp_when_cp).
    refusals = []
    graphs = getattr(config, "vision_cuda_graph_impl", "none")
    if graphs not in (None, "none"):
        refusals.append(
            (
                "vl_cuda_graphs",
                f"vision_cuda_graph_impl={graphs!r}: the EP-overlap plan does not number the vision tower's CUDA "
                f"graph replays by microbatch; fix: vision_cuda_graph_impl='none', {_OFF}",
            )
        )
    return refusals


def refuse_vision_language(model: torch.nn.Module) -> None:
    """Raises ValueError (one line, with its fix) for the first ``Qwen3VLModel`` feature the plan does not schedule."""
    if getattr(model, "use_dist_train", False) or not model.add_decoder:
        raise ValueError(
            "dist_train.use_dist_train: Qwen3VLModel's vision tower and language model on different ranks are not "
            f"scheduled by the EP-overlap plan; fix: set dist_train.use_dist_train=False, {_OFF}"
        )
    decided = _vision_language_refusals(model.config)
    if decided:
        raise ValueError(decided[0][1])


def _standalone_mtp_stage(config) -> int | None:
    """The pipeline rank whose last virtual stage holds the MTP layer but not the loss (unparsable layout: None)."""
    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if not getattr(config, "mtp_num_layers", None) or layout is None:
        return None
    from megatron.core.transformer.enums import LayerType

    if not hasattr(layout, "layout"):
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

        size = getattr(config, "pipeline_model_parallel_size", 1) or 1
        try:
            parse = PipelineParallelLayerLayout.from_str if isinstance(layout, str) else PipelineParallelLayerLayout
            layout = parse(layout, size)
        except (AssertionError, ValueError, KeyError, TypeError):
            return None
    stages = layout.layout  # [pipeline rank][virtual stage] -> layer kinds
    if LayerType.mtp in stages[-1][-1]:
        return None
    return next((rank for rank, row in enumerate(stages) if LayerType.mtp in row[-1]), None)


def _local_attention_layers(model: torch.nn.Module) -> list[int]:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return sorted({m.layer_number for m in model.modules() if type(m) is DotProductAttention})


def check_delayed_wgrad(layers: list) -> None:
    """With delayed wgrad: refuses layers that would lose weight gradients, warns about experts that delay nothing."""
    lost = sorted({name for layer in layers for name in layer.undelayable})
    if lost:
        raise ValueError(
            f"delay_wgrad_compute with {', '.join(lost)} layers built from Transformer Engine linears: their "
            "linears would defer weight gradients that nothing runs (they offer no backward_dw); fix: set "
            f"delay_wgrad_compute=False, {_OFF}"
        )
    undelayed = [layer.name for layer in layers if layer.is_moe and not layer.expert_wgrad_delayable]
    if undelayed:
        warn_rank0(
            logger,
            "delay_wgrad_compute: the experts of %s use Megatron-Core local linears, whose backward_dw() "
            "does nothing; their weight gradients stay in the experts' backward (nothing is delayed; "
            "numerics are unchanged). Build the model with Transformer Engine specs to delay them.",
            ", ".join(undelayed),
        )
