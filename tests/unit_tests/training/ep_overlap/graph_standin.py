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


class StandInGraph:
    """One layer's graph for one microbatch (see the module docstring)."""

    def __init__(self, layer, index: int):
        self.layer, self.index = layer, index

    def __call__(self, *args, is_first_microbatch=None, **kwargs):
        from megatron.core.transformer import cuda_graphs

        tensors = [("arg", a) for a in args] + sorted(kwargs.items())
        inputs = tuple((name, _checksum(t)) for name, t in tensors if isinstance(t, torch.Tensor))
        REPLAYS[(self.layer.layer_number, self.index, inputs)] += 1
        cuda_graphs._set_capture_start()
        try:
            return self.layer._te_cuda_graph_capture(*args, **kwargs)
        finally:
            cuda_graphs._set_capture_end()

    def backward_dw(self) -> None:
        WGRADS[(self.layer.layer_number, self.index)] += 1


def install() -> None:
    """Transformer Engine's replay arguments without Transformer Engine (the base class's: the tensors as given)."""
    from megatron.core.transformer.module import GraphableMegatronModule
    from megatron.core.transformer.transformer_layer import TransformerLayer

    TransformerLayer._get_te_cuda_graph_replay_args = GraphableMegatronModule._get_te_cuda_graph_replay_args


def capture(model, microbatches: int, modules: list[str]) -> int:
    """Graphs ``model``'s graphable layers (see the module docstring); returns how many layers got graphs."""
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
    for layer in model.decoder.layers:
        if _layer_is_graphable(layer, config):
            layer.cuda_graphs = [StandInGraph(layer, i) for i in range(microbatches)]
            graphed += 1
    return graphed
