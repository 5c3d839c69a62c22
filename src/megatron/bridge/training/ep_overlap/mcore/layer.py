"""Megatron-Core decoder layers as the schedule's units: an MoE layer cut into node functions, with the compute layers
that run before it.

Contract:
    * :class:`McoreLayer` gives a Megatron-Core ``TransformerLayer`` (``MoELayer`` with the ``alltoall`` or the
      ``flex`` token dispatcher, or a dense MLP) the node functions the schedule drives, built from Megatron-Core's
      own sub-steps (supported: the installed 0.19.x line):
          pre_dispatch  the ``before`` layers whole, then ``_forward_attention``, ``_forward_pre_mlp_layernorm``,
                        ``mlp.shared_experts_compute``, ``mlp.route``, ``mlp.preprocess`` (split counts, permute)
          dispatch      the dispatcher's tokens and probs, all-to-all'd by the schedule's comm lane with the
                        dispatcher's split sizes (what ``token_dispatch`` would do, but launched asynchronously)
          experts       ``mlp.routed_experts_compute`` (sort by local expert, experts, unsort)
          combine       all-to-all back, then ``mlp.postprocess`` and ``_forward_post_mlp`` (residual add)
      These are exactly the ops of the stack's forward, so losses and gradients stay bitwise equal.
    * The ``flex`` dispatcher (DeepEP, HybridEP, NCCL EP) moves its own tokens: a fused permute and all-to-all whose
      autograd backward is the reverse one. The layer then ``owns_comm`` (the chunk's ``Settings.moe_layers_own_comm``;
      another dispatcher is refused by the rules, ``token_dispatcher``): ``preprocess`` gives the tokens and their
      top-k probabilities, ``dispatch_comm`` is the dispatcher's ``token_dispatch``, ``combine_comm`` its
      ``token_combine``, and the schedule's comm lane runs them and their backward (on GPU on its comm stream, where
      the backend's asynchronous kernels overlap the other microbatch's compute). The backend's manager reads the
      probabilities from itself, so the layer points it at the node's inputs before each step that reads them.
    * A unit is an MoE group: the compute layers after one MoE layer (``before``: attention, MLP, Mamba, ... run
      whole, as the stack runs them) and the next MoE layer. A ``GPTModel`` layer is the group with nothing before
      it. :class:`McoreComputeRun` is a run of compute layers with no MoE layer after it (a dense unit).
    * The dispatcher (and a flex dispatcher's backend manager) keeps one microbatch's routing state on itself
      between ``preprocess`` and ``postprocess``. Two forwards of one layer may be in flight at once (edge pairing),
      so each microbatch's :class:`McoreRouting` saves their attributes after each step that sets them and puts them
      back before the next; a new microbatch starts from the state the last combine left, as in the stack's
      forward, not from another microbatch's in flight. Only what the dispatcher's own steps write is put back
      (:class:`StepWritten`): a setting changed between steps by someone else stays as they left it, such as the
      capacity factor Megatron-Core's ``PagedStashRunner`` clears to rerun a step on HybridEP's dynamic path.
    * Delayed wgrad: experts built from Transformer Engine linears offer ``backward_dw()`` and the schedule uses
      it. Megatron-Core's local linears have a ``backward_dw()`` that does nothing; their wgrad stays in the
      experts' backward (the plan warns once). A layer run whole gets its attention's ``backward_dw`` in the
      attention-wgrad slot (a GDN mixer's too: its projections); a Mamba mixer has none, so a Mamba layer whose
      Transformer Engine linears would defer weight gradients is refused by name (``undelayable``).
"""

import contextlib
import copy
import functools
from dataclasses import dataclass, field

import numpy as np
import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron.bridge.training.ep_overlap.contract import LayerHooks, PreDispatch
from megatron.bridge.training.ep_overlap.mcore.graphs import (
    pre_dispatch_backward_dw,
    replay_pre_dispatch,
    replays,
    replays_split,
    run_whole,
    set_microbatch,
)
from megatron.bridge.training.ep_overlap.mcore.quantization import layer_context
from megatron.bridge.training.ep_overlap.mcore.refusals import zero_copy_refusal


def _as_list(splits) -> list[int]:
    if isinstance(splits, torch.Tensor | np.ndarray):
        return [int(v) for v in splits.tolist()]
    return [int(v) for v in splits]


def uses_transformer_engine(module: torch.nn.Module) -> bool:
    return any(type(m).__module__.startswith("megatron.core.extensions.transformer_engine") for m in module.modules())


def run_stack_layer(
    layer: torch.nn.Module, x_SBH: torch.Tensor, attention_mask, rotary_pos_emb, packed_seq_params=None
) -> torch.Tensor:
    """One decoder layer whole, called as Megatron-Core's stacks call it (``TransformerBlock``, ``HybridStack``): a
    ``TransformerLayer`` (attention, MLP, GDN: ``G``) with the rotary embedding, any other layer (``MambaLayer``)
    without it. Both take the packed-sequence parameters: a Mamba mixer reads the documents' boundaries there
    (``seq_idx``), a GDN its ``cu_seqlens``."""
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
    """A node function of :class:`McoreLayer`, run inside its layer's low-precision context (``quantization.py``)."""

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
    """Layers whose Transformer Engine linears would defer their weight gradients with no ``backward_dw`` to run
    them (Megatron-Core's Mamba mixer has none): delayed wgrad would lose those gradients."""
    return [
        type(layer).__name__
        for layer in layers
        if hasattr(layer, "mixer") and not hasattr(layer.mixer, "backward_dw") and uses_transformer_engine(layer)
    ]


_ABSENT = object()  # an attribute a snapshot did not have


def _attributes(dispatcher) -> tuple[dict, dict]:
    """The dispatcher's attributes and its backend manager's (empty without one), as they are now."""
    manager = getattr(dispatcher, "_comm_manager", None)
    return dict(vars(dispatcher)), dict(getattr(manager, "__dict__", {}))


@dataclass
class StepWritten:
    """The attributes a dispatcher's own steps (``preprocess``, dispatch, experts, combine, ``postprocess``) have
    written so far, on the dispatcher and on its backend manager: the routing state. One per layer, shared by its
    microbatches. Everything else on them is a setting, which a restore never touches."""

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
    """One microbatch's dispatch in one layer: split sizes read from the Megatron-Core dispatcher, and the routing
    state for this microbatch of the dispatcher and of its backend manager, if it has one (their attributes, saved
    after each step that sets them; only those the steps write are put back, see :class:`StepWritten`)."""

    dispatcher: object
    written: StepWritten = field(default_factory=StepWritten)
    state: dict = field(default_factory=dict)
    in_splits: list[int] = field(default_factory=list)
    out_splits: list[int] = field(default_factory=list)
    manager_state: dict = field(default_factory=dict)
    exchanged: tuple | None = None  # (in_splits, out_splits) once read: what a replay must see again

    @classmethod
    def of(cls, dispatcher, written: StepWritten | None = None, before: tuple[dict, dict] | None = None):
        """The dispatcher's state as it is now; ``before``: its attributes before the step that just ran (what that
        step wrote joins ``written``)."""
        routing = cls(dispatcher, written if written is not None else StepWritten())
        if before is not None:
            routing.written.learn(before, _attributes(dispatcher))
        routing.save()
        return routing

    def save(self) -> None:
        """Takes the dispatcher's (and its manager's) attributes as this microbatch's state."""
        self.state, self.manager_state = _attributes(self.dispatcher)

    def restore(self) -> None:
        """Puts this microbatch's routing state back into the dispatcher (and its manager)."""
        _put_back(self.dispatcher, self.state, self.written.dispatcher)
        manager = getattr(self.dispatcher, "_comm_manager", None)
        if manager is not None:
            _put_back(manager, self.manager_state, self.written.manager)

    @contextlib.contextmanager
    def active(self):
        """The dispatcher holds this microbatch's state inside; another microbatch may use it in between."""
        self.restore()
        before = _attributes(self.dispatcher)
        yield self.dispatcher
        self.written.learn(before, _attributes(self.dispatcher))
        self.save()


class _Unit(LayerHooks):
    """What every unit shares: a name, the plan it reads masks from (or one microbatch's view), the stack call."""

    name: str
    chunk: object
    replays_forward = True  # full recompute: the node functions run again in backward, as the stack's checkpoint

    def bound_to(self, context):
        """The same unit, reading its attention mask, rotary embedding and packed-sequence parameters from
        ``context`` (one microbatch's), and the microbatch's index where the context has one."""
        bound = copy.copy(self)
        bound.chunk = context
        return bound

    @property
    def microbatch(self) -> int | None:
        """This microbatch's index in the step, under Megatron-Core's driver (the graph a replay reads)."""
        return getattr(self.chunk, "microbatch", None)

    def _run(self, layers, x_SBH: torch.Tensor) -> torch.Tensor:
        """``layers`` whole, each inside its low-precision context and replaying its graph, as the stacks run them."""
        chunk = self.chunk
        for layer in layers:
            set_microbatch(layer, self.microbatch)
            with layer_context(layer.config, layer):
                if replays_split(layer):
                    x_SBH = run_whole(layer, x_SBH, chunk)
                    continue
                mask, rotary, packed = chunk.attention_mask, chunk.rotary_pos_emb, chunk.packed_seq_params
                x_SBH = run_stack_layer(layer, x_SBH, mask, rotary, packed)
        return x_SBH

    def delayable_linears(self) -> list:
        return []  # Megatron-Core modules own their delay setting (config.delay_wgrad_compute at build time)


class McoreLayer(_Unit):
    """Node functions for one Megatron-Core ``TransformerLayer`` and the compute layers ``before`` it (see the module
    docstring)."""

    def __init__(self, layer: torch.nn.Module, index: int, chunk, before: list[torch.nn.Module] = ()):
        self.layer, self.chunk, self.before = layer, chunk, list(before)
        self.name = f"layer{index}"
        self.is_moe = isinstance(layer.mlp, MoELayer)
        config = layer.config
        # The dispatcher's kind is the chunk's settings' (which dispatchers the overlap takes: the rules', checked
        # before any overlapped step runs these nodes).
        self.owns_comm = self.is_moe and chunk.settings.moe_layers_own_comm
        # The state the last combine left (at first, the dispatcher as built): where a new microbatch starts. One
        # list that the per-microbatch copies (bound_to) share.
        self._combined = [McoreRouting.of(layer.mlp.token_dispatcher, StepWritten())] if self.is_moe else None
        zero_copy = zero_copy_refusal(config) if self.is_moe else None
        if zero_copy is not None:
            raise ValueError(f"{self.name}: {zero_copy}")
        self.expert_wgrad_delayable = self.is_moe and uses_transformer_engine(layer.mlp.experts)
        self.undelayable = _undelayable(self.before)

    def __call__(self, x_SBH: torch.Tensor) -> torch.Tensor:
        """The plain path: the layers as the stack runs them."""
        return self._run([*self.before, self.layer], x_SBH)

    # ---- node functions -----------------------------------------------------------------------------

    def pre_dispatch(self, x_SBH: torch.Tensor):
        layer = self.layer
        if x_SBH.dim() != 3 or x_SBH.shape[-1] != layer.config.hidden_size:
            raise ValueError(
                f"{self.name}: expected hidden states [seq, batch, {layer.config.hidden_size}], "
                f"got {tuple(x_SBH.shape)}"
            )
        x_SBH = self._run(self.before, x_SBH)  # each in its own context
        with layer_context(layer.config, layer):
            return self._layer_pre_dispatch(x_SBH)

    def _layer_pre_dispatch(self, x_SBH: torch.Tensor) -> PreDispatch:
        layer = self.layer
        before = None
        if self.is_moe:
            # Where the stack's forward leaves the dispatcher for the next microbatch: the state the last combine
            # left (a backend resets what its combine consumed, such as HybridEP's row count), not that of a
            # microbatch between its dispatch and its combine.
            start = self._combined[0]
            start.restore()
            before = _attributes(start.dispatcher)
        set_microbatch(layer, self.microbatch)
        if replays(layer):
            h, tokens, permuted_probs, shared = replay_pre_dispatch(layer, x_SBH, self.chunk)
            if not self.is_moe:
                return PreDispatch(h, (h,), None, None)
            return PreDispatch(h, (tokens, permuted_probs), shared, self._routing(before))
        h, _ = layer._forward_attention(
            hidden_states=x_SBH,
            attention_mask=self.chunk.attention_mask,
            rotary_pos_emb=self.chunk.rotary_pos_emb,
            packed_seq_params=self.chunk.packed_seq_params,
        )
        if not self.is_moe:  # the MLP part runs whole in experts, as the layer's forward runs it
            return PreDispatch(h, (h,), None, None)
        normed = layer._forward_pre_mlp_layernorm(h)
        if isinstance(normed, tuple):
            raise ValueError(f"{self.name}: fused residual norms are not supported by the EP-overlap plan")
        mlp = layer.mlp
        shared = mlp.shared_experts_compute(normed)
        probs, routing_map = mlp.route(normed)
        tokens, permuted_probs = mlp.preprocess(normed, probs, routing_map)
        return PreDispatch(h, (tokens, permuted_probs), shared, self._routing(before))

    def _routing(self, before: tuple[dict, dict]) -> McoreRouting:
        """The new microbatch's routing, once its ``pre_dispatch`` ran (what that wrote is routing state too)."""
        return McoreRouting.of(self.layer.mlp.token_dispatcher, self._combined[0].written, before)

    def start_split_exchange(self, routing: McoreRouting | None) -> None:
        """Nothing to send ahead: Megatron-Core's dispatcher exchanged the counts in ``preprocess`` (its semantics are
        kept); the device-to-host sync stays in :meth:`exchange_splits`."""

    def exchange_splits(self, routing: McoreRouting | None, *, op: str) -> None:
        """The dispatcher already exchanged split counts in preprocess; this is its device-to-host sync."""
        if routing is None or self.owns_comm:
            return
        with routing.active() as dispatcher:
            dispatcher.tokens_per_expert = dispatcher._maybe_dtoh_and_synchronize(
                "before_ep_alltoall", dispatcher.tokens_per_expert
            )
            routing.in_splits = _as_list(dispatcher.input_splits)
            routing.out_splits = _as_list(dispatcher.output_splits)
        routing.exchanged = (routing.in_splits, routing.out_splits)

    def replay_splits(self, routing: McoreRouting | None, exchanged) -> None:
        """A replayed forward (full recompute): Megatron-Core's dispatcher exchanged the counts again in
        ``preprocess`` (every rank replays the same layer at the same op), so this is its device-to-host sync, and a
        check that the replayed router routes as the first forward did."""
        self.exchange_splits(routing, op=f"{self.name} replay")
        if routing is not None and not self.owns_comm and routing.exchanged != tuple(exchanged):
            raise RuntimeError(
                f"{self.name}: the replayed router's split sizes {routing.exchanged} differ from its first forward's "
                f"{tuple(exchanged)}; full recompute needs deterministic routing (same inputs, same expert bias)"
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
        return output

    @_in_layer_context
    def dispatch_comm(self, sent: tuple[torch.Tensor, ...], routing: McoreRouting) -> tuple[torch.Tensor, ...]:
        """The flex dispatcher's fused permute and all-to-all of ``sent`` (tokens, top-k probabilities)."""
        tokens, probs = sent
        with routing.active() as dispatcher:
            dispatcher._comm_manager.token_probs = probs  # the backend sends the probabilities it holds
            return dispatcher.token_dispatch(tokens, probs)

    @_in_layer_context
    def combine_comm(self, expert_out: torch.Tensor, routing: McoreRouting) -> torch.Tensor:
        """The flex dispatcher's fused all-to-all back and unpermute."""
        with routing.active() as dispatcher:
            return dispatcher.token_combine(expert_out)

    @_in_layer_context
    def combine(self, back: torch.Tensor, shared, h: torch.Tensor, routing: McoreRouting | None) -> torch.Tensor:
        if routing is None:
            return back  # a dense layer's experts node added its residual
        with routing.active():
            output = self.layer.mlp.postprocess(back, shared)
        self._combined[0] = routing
        if self.layer.config.fp32_residual_connection:  # as _forward_mlp keeps its residual
            h = h.float()
        return self.layer._forward_post_mlp((output, None), h)

    # ---- delayed weight gradients -------------------------------------------------------------------

    def attention_backward_dw(self) -> None:
        """Everything ``pre_dispatch`` computed: the layers before, then this layer's attention and shared experts;
        for a dense layer its MLP too (the program runs no expert wgrad for a dense layer)."""
        for layer in self.before:
            whole_layer_backward_dw(layer, self.microbatch)
        if self.is_moe:
            pre_dispatch_backward_dw(self.layer, self.microbatch)
        else:
            whole_layer_backward_dw(self.layer, self.microbatch)

    def expert_backward_dw(self) -> None:
        """What ``experts`` computed: the routed experts (the call Megatron-Core's plan makes)."""
        if self.is_moe:
            self.layer.mlp.backward_dw()


class McoreComputeRun(_Unit):
    """Compute layers with no MoE layer after them (a hybrid stack's tail, or a chunk with no MoE layer): a dense
    unit. All but the last layer run in ``pre_dispatch``, the last in ``experts``, so each node computes something
    and the schedule pairs it like a dense layer."""

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
        """A dense unit sends nothing."""

    def exchange_splits(self, routing, *, op: str) -> None:
        """A dense unit sends nothing."""

    def experts(self, received: tuple[torch.Tensor, ...], routing) -> torch.Tensor:
        return self._run(self.layers[-1:], received[0])

    def combine(self, back: torch.Tensor, keep, h: torch.Tensor, routing) -> torch.Tensor:
        return back  # the last layer added its own residual

    def attention_backward_dw(self) -> None:
        """Every layer's: they ran whole (the last one's backward ran before this one's, in the experts node)."""
        for layer in self.layers:
            whole_layer_backward_dw(layer, self.microbatch)

    def expert_backward_dw(self) -> None:
        """No experts (the last layer's weight gradients run with the others in :meth:`attention_backward_dw`)."""
