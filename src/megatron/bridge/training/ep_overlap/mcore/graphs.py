"""Transformer Engine CUDA graphs of Megatron-Core layers, replayed by the plan where the plain path replays them.

A layer's call replays graph ``current_microbatch % len(cuda_graphs)`` (Megatron-Core's ``GraphableMegatronModule``);
:func:`set_microbatch` sets it before each replay, so two microbatches in flight each replay their own. A layer run
whole replays through its call; an MoE layer cut into nodes through ``_te_cuda_graph_replay``, which stops at the
dispatch with the overlap on, as in Megatron-Core's own plan. Only under Megatron-Core's driver (the engine refuses).
"""

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer


def replays(layer: torch.nn.Module) -> bool:
    """Whether ``layer``'s call replays a Transformer Engine graph now (captured graphs, training mode)."""
    return (
        getattr(layer.config, "cuda_graph_impl", "none") == "transformer_engine"
        and layer.training
        and bool(getattr(layer, "cuda_graphs", None))
    )


def graph_modules(layer: torch.nn.Module) -> set[str]:
    """The names of ``layer``'s graphed scopes (``cuda_graph_modules``)."""
    return {getattr(scope, "name", scope) for scope in layer.config.cuda_graph_modules or ()}


def set_microbatch(layer: torch.nn.Module, microbatch: int | None) -> None:
    """The graph index a replay of ``layer`` reads (Megatron-Core's ``set_current_microbatch``, for one layer)."""
    if microbatch is not None and replays(layer):
        layer.current_microbatch = microbatch


def replay_pre_dispatch(layer: torch.nn.Module, x_SBH: torch.Tensor, view) -> tuple:
    """``layer``'s graphed forward up to its dispatch, with the inputs Megatron-Core's plan passes:
    ``(residual, tokens, probs, shared)``, the last three None for a dense layer."""
    out = layer._te_cuda_graph_replay(
        hidden_states=x_SBH,
        attention_mask=view.attention_mask,
        rotary_pos_emb=view.rotary_pos_emb,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        packed_seq_params=view.packed_seq_params,
        sequence_len_offset=None,
    )
    mlp = getattr(layer, "mlp", None)
    if mlp is not None and hasattr(mlp, "cudagraph_tensor_store"):
        mlp.cudagraph_tensor_store.clear()  # consumed by route/preprocess; the next microbatch routes its own
    return out


def replays_split(layer: torch.nn.Module) -> bool:
    """Whether ``layer``'s own call would stop at its dispatch: a ``TransformerLayer`` replaying a graph with
    ``overlap_moe_expert_parallel_comm`` on returns its pre-dispatch outputs, not its output."""
    return replays(layer) and isinstance(layer, TransformerLayer) and layer.config.overlap_moe_expert_parallel_comm


def run_whole(layer: torch.nn.Module, x_SBH: torch.Tensor, view) -> torch.Tensor:
    """A graphed ``TransformerLayer`` the plan runs whole (a hybrid stack's attention layer): its graph, then the rest
    of the layer as its replay runs it with the overlap off (``_forward_mlp`` of the graph's output)."""
    residual = replay_pre_dispatch(layer, x_SBH, view)[0]
    return layer._forward_mlp(residual)


def pre_dispatch_backward_dw(layer: torch.nn.Module, microbatch: int | None) -> None:
    """The delayed wgrad of what ``layer`` computes before its dispatch (attention, shared experts):
    eager where its graph does not cover it, then the graph's ``backward_dw``, split as Megatron-Core's
    ``_BackwardDWWrapper`` splits it."""
    replayed = replays(layer) and microbatch is not None
    scopes = graph_modules(layer) if replayed else set()
    mlp = getattr(layer, "mlp", None)
    if getattr(layer, "is_moe_layer", False) and "moe_router" not in scopes:
        mlp.backward_dw(routed_experts=False, shared_experts=True)
    attention = getattr(layer, "self_attention", None)
    if attention is not None and hasattr(attention, "backward_dw") and "attn" not in scopes:
        attention.backward_dw()
    if replayed:
        layer._te_cuda_graph_backward_dw_graph(microbatch)
