"""Transformer Engine CUDA graphs of Megatron-Core layers, replayed by the plan where the plain path replays them.

Contract:
    * With ``cuda_graph_impl="transformer_engine"``, Megatron-Bridge captures, before the first step, one graphed
      callable per layer and microbatch (``layer.cuda_graphs``) over the layer's scopes (``cuda_graph_modules``:
      ``attn``, ``moe_router``, ``moe_preprocess``, ``mamba``; ``moe``/``mlp`` are refused with the overlap). A
      layer's call then replays graph ``current_microbatch % len(cuda_graphs)`` (Megatron-Core's
      ``GraphableMegatronModule``), and Megatron-Core's drivers set ``current_microbatch`` before each forward.
    * The plan replays the same graphs with the same inputs: a layer it runs whole replays through its own call; an
      MoE layer cut into nodes replays in its ``pre_dispatch`` through ``layer._te_cuda_graph_replay``, which, with
      ``overlap_moe_expert_parallel_comm`` on, returns the pre-dispatch outputs (residual, tokens, probabilities,
      shared experts' output) and leaves dispatch, experts and combine to the schedule, as Megatron-Core's own plan
      does. :func:`set_microbatch` gives each replay its microbatch's index first, so two microbatches in flight
      each replay their own graph.
    * Delayed wgrad: a graphed scope's weight gradients are its graph's ``backward_dw`` for that microbatch; the
      rest stay eager, split as Megatron-Core's ``_BackwardDWWrapper`` splits them (:func:`pre_dispatch_backward_dw`).
    * Only under Megatron-Core's driver (the pre-wrap hook): the engine does not number microbatches for the plain
      path's replays, so the lab's engine refuses graphed layers.
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
    return {getattr(scope, "name", scope) for scope in layer.config.cuda_graph_modules or ()}


def set_microbatch(layer: torch.nn.Module, microbatch: int | None) -> None:
    """The graph index a replay of ``layer`` reads (Megatron-Core's ``set_current_microbatch``, for one layer)."""
    if microbatch is not None and replays(layer):
        layer.current_microbatch = microbatch


def replay_pre_dispatch(layer: torch.nn.Module, x_SBH: torch.Tensor, view) -> tuple:
    """The graphed forward of ``layer`` up to its dispatch: ``(residual, tokens, probs, shared)`` (tokens, probs and
    shared None for a dense layer), with the inputs Megatron-Core's plan passes."""
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
    """The delayed weight gradients of what ``layer`` computes before its dispatch: attention, and an MoE layer's
    shared experts, eagerly where its graph does not cover them, then its graph's own ``backward_dw``."""
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
