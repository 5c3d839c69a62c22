"""Transformer Engine CUDA graphs of Megatron-Core layers, replayed by the plan where the plain path replays them.

A replay reads graph ``current_microbatch % len(cuda_graphs)``; :func:`set_microbatch` sets it per microbatch. An MoE
layer cut into nodes replays through ``_te_cuda_graph_replay``, which stops at the dispatch with the overlap on.
"""

import contextlib

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
    """``layer``'s graph replayed up to its dispatch as Megatron-Core's plan does: residual, tokens, probs, shared."""
    out = layer._te_cuda_graph_replay(
        hidden_states=x_SBH,
        attention_mask=view.attention_mask,
        rotary_pos_emb=view.rotary_pos_emb,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        packed_seq_params=view.packed_seq_params,
        sequence_len_offset=None,
    )
    _routed(layer)
    return out


def _routed(layer: torch.nn.Module) -> None:
    """After a split replay: the graph's outputs the layer keeps were consumed by route/preprocess."""
    mlp = getattr(layer, "mlp", None)
    if mlp is not None and hasattr(mlp, "cudagraph_tensor_store"):
        mlp.cudagraph_tensor_store.clear()  # the next microbatch routes its own


def replays_split(layer: torch.nn.Module) -> bool:
    """Whether ``layer``'s call returns pre-dispatch outputs (a graphed ``TransformerLayer`` with the overlap on)."""
    return replays(layer) and isinstance(layer, TransformerLayer) and layer.config.overlap_moe_expert_parallel_comm


def run_whole(layer: torch.nn.Module, x_SBH: torch.Tensor, view) -> torch.Tensor:
    """A graphed ``TransformerLayer`` run whole: its graph, then ``_forward_mlp`` (its replay with the overlap off)."""
    residual = replay_pre_dispatch(layer, x_SBH, view)[0]
    return layer._forward_mlp(residual)


@contextlib.contextmanager
def mtp_layers_whole(mtp_block: torch.nn.Module | None, microbatch: int | None):
    """Inside the block, the graphed layer of each MTP depth (Megatron-Core graphs ``mtp_model_layer`` as a decoder
    layer) replays its own microbatch's graph and runs whole, as :func:`run_whole` runs a decoder layer: the plan runs
    the MTP block whole in its head, where the graph's replay would stop at the dispatch."""
    layers = [depth.mtp_model_layer for depth in getattr(mtp_block, "layers", ())]
    layers = [layer for layer in layers if replays_split(layer)]
    for layer in layers:
        set_microbatch(layer, microbatch)
        replay = layer._te_cuda_graph_replay

        def replay_whole(*args, layer=layer, replay=replay, **kwargs):
            residual = replay(*args, **kwargs)[0]
            _routed(layer)
            return layer._forward_mlp(residual, packed_seq_params=kwargs.get("packed_seq_params")), None

        layer._te_cuda_graph_replay = replay_whole  # read by the layer's __call__, before its class's
    try:
        yield
    finally:
        for layer in layers:
            del layer._te_cuda_graph_replay


def pre_dispatch_backward_dw(layer: torch.nn.Module, microbatch: int | None) -> None:
    """Delayed wgrad of ``layer`` before its dispatch: eager where no graph covers it, then the graph's
    ``backward_dw``, split as Megatron-Core's ``_BackwardDWWrapper`` splits it."""
    replayed = replays(layer) and microbatch is not None
    scopes = graph_modules(layer) if replayed else set()
    mlp = getattr(layer, "mlp", None)
    if getattr(layer, "is_moe_layer", False) and "moe_router" not in scopes:
        mlp.backward_dw(routed_experts=False, shared_experts=True)
    attention = getattr(layer, "self_attention", None)
    if attention is not None and hasattr(attention, "backward_dw") and "attn" not in scopes:
        attention.backward_dw()
        # DSA's indexer linears defer theirs too; Megatron-Core's attention backward_dw does not run them.
        indexer = getattr(getattr(attention, "core_attention", None), "indexer", None)
        for module in indexer.children() if indexer is not None else ():
            if hasattr(module, "backward_dw"):
                module.backward_dw()
    if replayed:
        layer._te_cuda_graph_backward_dw_graph(microbatch)
