"""Megatron-Core decoder layers as the schedule's layers: an MoE layer cut into nodes, with the layers before it.

Nodes are Megatron-Core 0.19.x's own sub-steps in the stack's op order (bitwise equal): pre_dispatch
(``_forward_attention``, ``_forward_pre_mlp_layernorm``, shared experts, ``route``, ``preprocess``), dispatch, experts
(``routed_experts_compute``), combine (``postprocess``, ``_forward_post_mlp``). The dispatcher keeps routing state on
itself, so each microbatch's :class:`McoreRouting` puts back what the dispatcher's own steps wrote.
"""

import contextlib
import copy
import functools
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
from megatron.core.models.common.utils import should_free_input
from megatron.core.tensor_parallel.random import _fork_rng, _get_all_rng_states, _set_all_rng_states
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron.bridge.training.ep_overlap.contract import LayerHooks, PreDispatch
from megatron.bridge.training.ep_overlap.mcore.graphs import (
    graph_modules,
    pre_dispatch_backward_dw,
    replay_pre_dispatch,
    replays,
    replays_split,
    run_whole,
    set_microbatch,
)
from megatron.bridge.training.ep_overlap.mcore.quantization import layer_context
from megatron.bridge.training.ep_overlap.mcore.refusals import moe_recompute_graph_refusal, zero_copy_refusal


def _as_list(splits) -> list[int]:
    if isinstance(splits, torch.Tensor | np.ndarray):
        return [int(v) for v in splits.tolist()]
    return [int(v) for v in splits]


def uses_transformer_engine(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds any of Megatron-Core's Transformer Engine extension modules."""
    return any(type(m).__module__.startswith("megatron.core.extensions.transformer_engine") for m in module.modules())


def run_stack_layer(
    layer: torch.nn.Module, x_SBH: torch.Tensor, attention_mask, rotary_pos_emb, packed_seq_params=None
) -> torch.Tensor:
    """One decoder layer whole, as ``TransformerBlock``/``HybridStack`` call it (a ``MambaLayer`` gets no rotary)."""
    if isinstance(layer, TransformerLayer):
        out, _ = layer(
            hidden_states=x_SBH,
            attention_mask=attention_mask,
            rotary_pos_emb=rotary_pos_emb,
            packed_seq_params=packed_seq_params,
        )
    else:
        out = layer(hidden_states=x_SBH, attention_mask=attention_mask, packed_seq_params=packed_seq_params)
    return out[0] if isinstance(out, tuple) else out


def _in_layer_context(node):
    @functools.wraps(node)
    def run(self, *args, **kwargs):
        with layer_context(self.layer.config, self.layer):
            return node(self, *args, **kwargs)

    return run


def whole_layer_backward_dw(layer: torch.nn.Module, microbatch: int | None) -> None:
    """The delayed weight gradients of a layer the plan runs whole (attention, a dense MLP; graphed or eager)."""
    pre_dispatch_backward_dw(layer, microbatch)
    mlp = getattr(layer, "mlp", None)
    if mlp is not None and not getattr(layer, "is_moe_layer", False) and hasattr(mlp, "backward_dw"):
        mlp.backward_dw()


def _undelayable(layers) -> list[str]:
    """Layers whose TE linears would defer weight gradients with no ``backward_dw`` to run them (Mamba mixers)."""
    return [
        type(layer).__name__
        for layer in layers
        if hasattr(layer, "mixer") and not hasattr(layer.mixer, "backward_dw") and uses_transformer_engine(layer)
    ]


def routed_experts_backward_dw(mlp: torch.nn.Module) -> None:
    """The delayed weight gradients of an MoE layer after its dispatch: the experts', a latent output projection's."""
    latent = getattr(mlp, "fc2_latent_proj", None)
    if latent is None:
        mlp.backward_dw()
        return
    # Megatron-Core runs the latent output projection's deferred wgrad on its comm stream, where its own plan
    # runs that projection (the combine node); ours runs it in the combine compute node, so its wgrad goes here.
    mlp.experts.backward_dw()
    latent.backward_dw()


def mtp_backward_dw(mtp_block: torch.nn.Module, microbatch: int | None) -> None:
    """The delayed weight gradients of the MTP block the head runs whole: each depth's projection and layers, once
    per forward use (Transformer Engine's ``backward_dw`` runs one deferred wgrad a call; a repeated MTP layer runs
    ``mtp_num_layers`` times)."""
    uses = mtp_block.config.mtp_num_layers if getattr(mtp_block, "mtp_use_repeated_layer", False) else 1
    for depth in list(mtp_block.layers) * uses:
        if hasattr(depth.eh_proj, "backward_dw"):
            depth.eh_proj.backward_dw()
        stack = depth.mtp_model_layer
        for layer in getattr(stack, "layers", [stack]):  # a hybrid MTP depth is a stack
            whole_layer_backward_dw(layer, microbatch)
            if getattr(layer, "is_moe_layer", False):
                routed_experts_backward_dw(layer.mlp)


_ABSENT = object()


def _attributes(dispatcher) -> tuple[dict, dict]:
    manager = getattr(dispatcher, "_comm_manager", None)
    return dict(vars(dispatcher)), dict(getattr(manager, "__dict__", {}))


@dataclass
class StepWritten:
    """The attributes a dispatcher's own steps wrote on it and its backend manager (routing state, not settings)."""

    dispatcher: set[str] = field(default_factory=set)
    manager: set[str] = field(default_factory=set)

    def learn(self, before: tuple[dict, dict], after: tuple[dict, dict]) -> None:
        """Adds what one step changed (a new value object: the step assigned it) between ``before`` and ``after``."""
        for written, old, new in zip((self.dispatcher, self.manager), before, after):
            written.update(k for k in old.keys() | new.keys() if old.get(k, _ABSENT) is not new.get(k, _ABSENT))


def _put_back(owner, state: dict, written: set[str]) -> None:
    for name in written:
        value = state.get(name, _ABSENT)
        if value is not _ABSENT:
            setattr(owner, name, value)


@dataclass
class McoreRouting:
    """One microbatch's dispatch in one layer: its split sizes and the routing state it left on the dispatcher."""

    dispatcher: object
    written: StepWritten = field(default_factory=StepWritten)
    state: dict = field(default_factory=dict)
    in_splits: list[int] = field(default_factory=list)
    out_splits: list[int] = field(default_factory=list)
    manager_state: dict = field(default_factory=dict)
    exchanged: tuple | None = None  # (in_splits, out_splits) once read: what a replay must see again
    norm_checkpoint: object = None  # recompute of 'layernorm': this microbatch's pre-MLP norm checkpoint

    @classmethod
    def of(cls, dispatcher, written: StepWritten | None = None, before: tuple[dict, dict] | None = None):
        routing = cls(dispatcher, written if written is not None else StepWritten())
        if before is not None:
            routing.written.learn(before, _attributes(dispatcher))
        routing.save()
        return routing

    def save(self) -> None:
        self.state, self.manager_state = _attributes(self.dispatcher)

    def restore(self) -> None:
        _put_back(self.dispatcher, self.state, self.written.dispatcher)
        manager = getattr(self.dispatcher, "_comm_manager", None)
        if manager is not None:
            _put_back(manager, self.manager_state, self.written.manager)

    @contextlib.contextmanager
    def active(self):
        """The dispatcher holds this microbatch's state inside the block."""
        self.restore()
        before = _attributes(self.dispatcher)
        yield self.dispatcher
        self.written.learn(before, _attributes(self.dispatcher))
        self.save()


@contextlib.contextmanager
def _own_shared_topk(config, view):
    """DSA layers reusing an earlier layer's top-k (``dsa_indexer_topk_freq > 1``) read it from a holder the model
    config carries when a microbatch has no mask or packed parameters. Under full recompute a replay runs after other
    microbatches' forwards wrote there, so inside the block the config carries ``view``'s own holders."""
    if (getattr(config, "dsa_indexer_topk_freq", None) or 1) <= 1 or config.recompute_granularity != "full":
        yield
        return
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention

    names = (DSAttention._HOLDER_ATTR, DSAttention._LENGTH_HOLDER_ATTR)
    if getattr(view, "shared_topk", None) is None:
        view.shared_topk = ({}, {})
    found = [getattr(config, name, None) for name in names]
    for name, holder in zip(names, view.shared_topk):
        setattr(config, name, holder)
    try:
        yield
    finally:
        for name, holder in zip(names, found):
            setattr(config, name, holder)


@contextlib.contextmanager
def _norm_recompute_registered(layer: torch.nn.Module):
    """``_forward_post_mlp`` without registering the pre-MLP norm's recompute: the experts node registered it."""
    recompute, layer.recompute_pre_mlp_layernorm = layer.recompute_pre_mlp_layernorm, False
    try:
        yield
    finally:
        layer.recompute_pre_mlp_layernorm = recompute


class _ScheduledLayer(LayerHooks):
    name: str
    chunk: object
    replays_forward = True  # full recompute: the node functions run again in backward, as the stack's checkpoint

    def bound_to(self, context):
        """A copy reading masks, rotary embedding and packed-sequence parameters from ``context`` (a microbatch's,
        which holds the copy: a weak reference, so the two are no cycle left for the garbage collector)."""
        bound = copy.copy(self)
        bound.chunk = weakref.proxy(context)
        return bound

    @property
    def microbatch(self) -> int | None:
        return getattr(self.chunk, "microbatch", None)

    def rng_states(self):
        """What Megatron-Core's checkpoint saves: CPU, CUDA and tracker states (forced load balancing draws the
        router's logits from the expert-parallel tracker)."""
        return _get_all_rng_states()

    @contextlib.contextmanager
    def rng_restored(self, states):
        with _fork_rng():
            _set_all_rng_states(*states)
            yield

    def _run(self, layers, x_SBH: torch.Tensor) -> torch.Tensor:
        chunk = self.chunk
        for layer in layers:
            set_microbatch(layer, self.microbatch)
            with layer_context(layer.config, layer), _own_shared_topk(layer.config, chunk):
                if replays_split(layer):
                    x_SBH = run_whole(layer, x_SBH, chunk)
                    continue
                mask, rotary, packed = chunk.attention_mask, chunk.rotary_pos_emb, chunk.packed_seq_params
                x_SBH = run_stack_layer(layer, x_SBH, mask, rotary, packed)
        return x_SBH

    def delayable_linears(self) -> list:
        return []  # Megatron-Core modules own their delay setting (config.delay_wgrad_compute at build time)


class McoreLayer(_ScheduledLayer):
    """Node functions for a Megatron-Core ``TransformerLayer`` and the compute layers ``before`` it."""

    def __init__(self, layer: torch.nn.Module, index: int, chunk, before: list[torch.nn.Module] = ()):
        self.layer, self.chunk, self.before = layer, chunk, list(before)
        self.name = f"layer{index}"
        self.is_moe = isinstance(layer.mlp, MoELayer)
        config = layer.config
        self.owns_comm = self.is_moe and chunk.settings.moe_layers_own_comm
        # Where a new microbatch starts: the state the last combine left (first: as built); bound_to copies share it.
        self._combined = [McoreRouting.of(layer.mlp.token_dispatcher, StepWritten())] if self.is_moe else None
        zero_copy = zero_copy_refusal(config) if self.is_moe else None
        if zero_copy is not None:
            raise ValueError(f"{self.name}: {zero_copy}")
        self.expert_wgrad_delayable = self.is_moe and uses_transformer_engine(layer.mlp.experts)
        self.undelayable = _undelayable(self.before)
        # 'moe' in recompute_modules: the plan replays the MoE part in backward (a one-layer recompute segment).
        self.recomputes_moe = self.is_moe and bool(getattr(layer.mlp, "moe_layer_recompute", False))
        if self.recomputes_moe:
            attention = not isinstance(layer.self_attention, IdentityOp)
            graphed = moe_recompute_graph_refusal(config, has_attention=attention)
            if graphed is not None:
                raise ValueError(f"{self.name}: {graphed}")

    def __call__(self, x_SBH: torch.Tensor) -> torch.Tensor:
        return self._run([*self.before, self.layer], x_SBH)

    def pre_dispatch(self, x_SBH: torch.Tensor):
        layer = self.layer
        x_SBH = self._run(self.before, x_SBH)
        with layer_context(layer.config, layer), _own_shared_topk(layer.config, self.chunk):
            return self._layer_pre_dispatch(x_SBH)

    def attention(self, x_SBH: torch.Tensor) -> torch.Tensor:
        """With ``recomputes_moe``: the layers before and the attention, whose output the MoE part starts from."""
        layer = self.layer
        x_SBH = self._run(self.before, x_SBH)
        with layer_context(layer.config, layer), _own_shared_topk(layer.config, self.chunk):
            set_microbatch(layer, self.microbatch)
            return self._attention(x_SBH)

    def moe_pre_dispatch(self, h_SBH: torch.Tensor) -> PreDispatch:
        """With ``recomputes_moe``: the MoE part of ``pre_dispatch`` from the attention's output ``h_SBH``, run in
        the forward without a graph and again in the backward, as Megatron-Core's checkpoint of the MoE layer."""
        layer = self.layer
        with layer_context(layer.config, layer), _own_shared_topk(layer.config, self.chunk):
            return self._moe_pre_dispatch(h_SBH, self._start_routing())

    def _start_routing(self) -> tuple[dict, dict] | None:
        """Puts back the state the last combine left (a backend resets what it consumed: HybridEP's row count)."""
        if not self.is_moe:
            return None
        start = self._combined[0]
        start.restore()
        return _attributes(start.dispatcher)

    def _attention(self, x_SBH: torch.Tensor) -> torch.Tensor:
        h, _ = self.layer._forward_attention(
            hidden_states=x_SBH,
            attention_mask=self.chunk.attention_mask,
            rotary_pos_emb=self.chunk.rotary_pos_emb,
            packed_seq_params=self.chunk.packed_seq_params,
        )
        return h

    def _layer_pre_dispatch(self, x_SBH: torch.Tensor) -> PreDispatch:
        layer = self.layer
        before = self._start_routing()
        set_microbatch(layer, self.microbatch)
        if replays(layer):
            h, tokens, permuted_probs, shared = replay_pre_dispatch(layer, x_SBH, self.chunk)
            if not self.is_moe:
                return PreDispatch(h, (h,), None, None)
            return PreDispatch(h, (tokens, permuted_probs), shared, self._routing(before))
        h = self._attention(x_SBH)
        if not self.is_moe:  # the MLP part runs whole in experts, as the layer's forward runs it
            return PreDispatch(h, (h,), None, None)
        return self._moe_pre_dispatch(h, before)

    def _moe_pre_dispatch(self, h: torch.Tensor, before: tuple[dict, dict]) -> PreDispatch:
        layer = self.layer
        normed = layer._forward_pre_mlp_layernorm(h)
        if isinstance(normed, tuple):
            raise ValueError(f"{self.name}: fused residual norms are not supported by the EP-overlap plan")
        mlp = layer.mlp
        shared = mlp.shared_experts_compute(normed)
        probs, routing_map = mlp.route(normed)
        tokens, permuted_probs = mlp.preprocess(normed, probs, routing_map)
        return PreDispatch(h, (tokens, permuted_probs), shared, self._routing(before))

    def _routing(self, before: tuple[dict, dict]) -> McoreRouting:
        layer = self.layer
        routing = McoreRouting.of(layer.mlp.token_dispatcher, self._combined[0].written, before)
        # A graph holding the router ran the norm and registered its recompute on the graph's outputs: the checkpoint
        # the layer keeps is then its capture's, spent. Else the layer keeps one; another microbatch may replace it.
        graphed = replays(layer) and "moe_router" in graph_modules(layer)
        if layer.recompute_pre_mlp_layernorm and not graphed:
            routing.norm_checkpoint = layer.pre_mlp_norm_checkpoint
        return routing

    def frees_input(self, node: str) -> bool:
        experts = self.layer.mlp.num_local_experts if self.is_moe else None
        return should_free_input(node, self.is_moe, self.layer.config, experts)

    def start_split_exchange(self, routing: McoreRouting | None) -> None:
        """Nothing to send ahead: Megatron-Core's dispatcher exchanged the counts in ``preprocess``."""

    def exchange_splits(self, routing: McoreRouting | None, *, op: str) -> None:
        """The dispatcher's device-to-host sync of its counts (Megatron-Core's ``_maybe_dtoh_and_synchronize``)."""
        if routing is None or self.owns_comm:
            return
        with routing.active() as dispatcher:
            dispatcher.tokens_per_expert = dispatcher._maybe_dtoh_and_synchronize(
                "before_ep_alltoall", dispatcher.tokens_per_expert
            )
            if getattr(dispatcher, "drop_and_pad", False):  # padded to capacity: equal shares, no sizes given
                share = [int(dispatcher.num_out_tokens) // dispatcher.ep_size] * dispatcher.ep_size
                routing.in_splits, routing.out_splits = share, list(share)
            else:
                routing.in_splits = _as_list(dispatcher.input_splits)
                routing.out_splits = _as_list(dispatcher.output_splits)
        routing.exchanged = (routing.in_splits, routing.out_splits)

    def replay_splits(self, routing: McoreRouting | None, exchanged) -> None:
        """Full recompute's replay (``preprocess`` exchanged the counts again): the sync, and a routing check."""
        self.exchange_splits(routing, op=f"{self.name} replay")
        if routing is not None and not self.owns_comm and routing.exchanged != tuple(exchanged):
            raise RuntimeError(
                f"{self.name}: the replayed router's split sizes {routing.exchanged} differ from its first forward's "
                f"{tuple(exchanged)}; a replay needs deterministic routing (same inputs, same expert bias)"
            )

    @_in_layer_context
    def experts(self, received: tuple[torch.Tensor, ...], routing: McoreRouting | None) -> torch.Tensor:
        if routing is None:  # a dense layer: norm, MLP (chunked or recomputed as configured) and residual
            return self.layer._forward_mlp(received[0], packed_seq_params=self.chunk.packed_seq_params)
        tokens, probs = received
        with routing.active() as dispatcher:
            if self.owns_comm:  # the backend's permute reads the received probabilities from its manager
                dispatcher._comm_manager.dispatched_probs = probs
            output, _ = self.layer.mlp.routed_experts_compute(tokens, probs)
        if routing.norm_checkpoint is not None:  # as Megatron-Core's plan: the norm's output rebuilt before this
            routing.norm_checkpoint.discard_output_and_register_recompute(output)  # node's backward
            routing.norm_checkpoint = None
        return output

    @_in_layer_context
    def dispatch_comm(self, sent: tuple[torch.Tensor, ...], routing: McoreRouting) -> tuple[torch.Tensor, ...]:
        tokens, probs = sent
        with routing.active() as dispatcher:
            dispatcher._comm_manager.token_probs = probs  # the backend sends the probabilities it holds
            return dispatcher.token_dispatch(tokens, probs)

    @_in_layer_context
    def combine_comm(self, expert_out: torch.Tensor, routing: McoreRouting) -> torch.Tensor:
        with routing.active() as dispatcher:
            return dispatcher.token_combine(expert_out)

    @_in_layer_context
    def combine(self, back: torch.Tensor, shared, h: torch.Tensor, routing: McoreRouting | None) -> torch.Tensor:
        if routing is None:
            return back  # a dense layer's experts node added its residual
        with routing.active():
            output = self.layer.mlp.postprocess(back, shared)
        previous, self._combined[0] = self._combined[0], routing
        if previous is not routing:  # its forward is done: it keeps its splits, not the dispatcher's tensors
            previous.state, previous.manager_state = {}, {}
        if self.layer.config.fp32_residual_connection:  # as _forward_mlp keeps its residual
            h = h.float()
        with _norm_recompute_registered(self.layer):
            return self.layer._forward_post_mlp((output, None), h)

    def attention_backward_dw(self) -> None:
        """What ``pre_dispatch`` computed: the layers before, attention and shared experts (a dense layer's MLP)."""
        for layer in self.before:
            whole_layer_backward_dw(layer, self.microbatch)
        if self.is_moe:
            pre_dispatch_backward_dw(self.layer, self.microbatch)
        else:
            whole_layer_backward_dw(self.layer, self.microbatch)

    def expert_backward_dw(self) -> None:
        if self.is_moe:
            routed_experts_backward_dw(self.layer.mlp)


class McoreComputeRun(_ScheduledLayer):
    """Compute layers with no MoE layer after them: all but the last in ``pre_dispatch``, the last in ``experts``."""

    is_moe = False
    expert_wgrad_delayable = False
    owns_comm = False

    def __init__(self, layers: list[torch.nn.Module], index: int, chunk):
        self.layers, self.chunk = list(layers), chunk
        self.name = f"layer{index}"
        self.undelayable = _undelayable(self.layers)

    def __call__(self, x_SBH: torch.Tensor) -> torch.Tensor:
        return self._run(self.layers, x_SBH)

    def pre_dispatch(self, x_SBH: torch.Tensor):
        z_SBH = self._run(self.layers[:-1], x_SBH)
        return PreDispatch(z_SBH, (z_SBH,), None, None)

    def start_split_exchange(self, routing) -> None:
        """A dense run sends nothing."""

    def exchange_splits(self, routing, *, op: str) -> None:
        """A dense run sends nothing."""

    def experts(self, received: tuple[torch.Tensor, ...], routing) -> torch.Tensor:
        return self._run(self.layers[-1:], received[0])

    def combine(self, back: torch.Tensor, keep, h: torch.Tensor, routing) -> torch.Tensor:
        return back  # the last layer added its own residual

    def attention_backward_dw(self) -> None:
        for layer in self.layers:
            whole_layer_backward_dw(layer, self.microbatch)

    def expert_backward_dw(self) -> None:
        """Nothing: :meth:`attention_backward_dw` runs every layer's."""
