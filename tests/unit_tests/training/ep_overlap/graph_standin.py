"""Test-only: stands in for Transformer Engine's graphed callables (``make_graphed_callables`` needs a GPU).

:func:`capture` does what Megatron-Bridge's graph helper does before the first step: it gives every layer Megatron-Core
would graph for the config's ``cuda_graph_modules`` (its ``_layer_is_graphable``) one callable per microbatch in
``layer.cuda_graphs``. A callable computes what its graph holds: the layer's capture function
(``_te_cuda_graph_capture``), run eagerly under Megatron-Core's capture flag, so an MoE layer returns at the end of
its graphed scope as it does while captured. Each replay is recorded with the graph's index and a checksum of every
tensor it was given; each ``backward_dw`` of a graph is recorded too.
"""

from collections import Counter

import torch

REPLAYS: Counter = Counter()  # (layer number, graph index, inputs) -> replays
WGRADS: Counter = Counter()  # (layer number, graph index) -> backward_dw calls


def _checksum(value) -> tuple:
    return (tuple(value.shape), value.detach().double().sum().item())


class _IntoStatic(torch.autograd.Function):
    """A graphed callable's output: its static buffer, written by the replay and ``.detach()``ed (the same storage on
    every replay), tied to the graph's backward (here the eager computation's)."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        buffer.copy_(value)
        return buffer.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _written(buffers: list, position: int, value):
    if not isinstance(value, torch.Tensor):
        return value
    if position == len(buffers):
        buffers.append(torch.empty_like(value))
    buffer = buffers[position]
    if buffer.untyped_storage().nbytes() < value.nbytes:
        raise RuntimeError("a graph replay writes into its static output buffer, which was freed")
    if value.requires_grad:
        return _IntoStatic.apply(value, buffer)
    return buffer.copy_(value).detach()


class StandInGraph:
    """One layer's graph for one microbatch (see the module docstring); ``static``: its outputs are static buffers,
    as Transformer Engine's are (the same storage on every replay)."""

    def __init__(self, layer, index: int, static: bool = False):
        self.layer, self.index, self.static = layer, index, static
        self.buffers: list[torch.Tensor] = []

    def __call__(self, *args, is_first_microbatch=None, **kwargs):
        from megatron.core.transformer import cuda_graphs

        tensors = [("arg", a) for a in args] + sorted(kwargs.items())
        inputs = tuple((name, _checksum(t)) for name, t in tensors if isinstance(t, torch.Tensor))
        REPLAYS[(self.layer.layer_number, self.index, inputs)] += 1
        cuda_graphs._set_capture_start()
        try:
            out = self.layer._te_cuda_graph_capture(*args, **kwargs)
        finally:
            cuda_graphs._set_capture_end()
        if not self.static:
            return out
        if isinstance(out, tuple):
            return tuple(_written(self.buffers, i, value) for i, value in enumerate(out))
        return _written(self.buffers, 0, out)

    def backward_dw(self) -> None:
        WGRADS[(self.layer.layer_number, self.index)] += 1


def install() -> None:
    """Transformer Engine's replay arguments without Transformer Engine (the base class's: the tensors as given)."""
    from megatron.core.transformer.module import GraphableMegatronModule
    from megatron.core.transformer.transformer_layer import TransformerLayer

    TransformerLayer._get_te_cuda_graph_replay_args = GraphableMegatronModule._get_te_cuda_graph_replay_args


def capture(model, microbatches: int, modules: list[str], static: bool = False) -> int:
    """Graphs ``model``'s graphable layers (see the module docstring; ``static``: see :class:`StandInGraph`); returns
    how many layers got graphs."""
    from megatron.core.transformer.cuda_graphs import _layer_is_graphable
    from megatron.core.transformer.enums import CudaGraphModule
    from megatron.core.transformer.module import GraphableMegatronModule

    config = model.config
    config.cuda_graph_impl = "transformer_engine"
    config.cuda_graph_modules = [CudaGraphModule[name] for name in modules]
    for module in model.modules():  # what a module built with the setting has (the block too)
        if isinstance(module, GraphableMegatronModule):
            module.cuda_graphs, module.cuda_graph_manual_hooks, module.cuda_graph_backward_dw_wrapper = [], [], None
    graphed = 0
    depths = [depth.mtp_model_layer for depth in getattr(getattr(model, "mtp", None), "layers", ())]
    for layer in [*model.decoder.layers, *depths]:  # Megatron-Core graphs each MTP depth's layer too
        if _layer_is_graphable(layer, config):
            layer.cuda_graphs = [StandInGraph(layer, i, static) for i in range(microbatches)]
            graphed += 1
    return graphed
