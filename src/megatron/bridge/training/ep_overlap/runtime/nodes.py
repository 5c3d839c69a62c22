"""The nodes of one microbatch in one model chunk, each its own autograd segment, one method per program op
(``<kind>_<name>``). A unit that ``owns_comm`` runs its fused dispatch/combine (and their backward) on the comm lane.
Bitwise equal to the plain path: each node runs exactly the layer's plain ops, and the residual ``h`` gets its two
gradients in one sum."""

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import torch

from megatron.bridge.training.ep_overlap.contract import segment_of
from megatron.bridge.training.ep_overlap.runtime.lanes import Pending, done


@dataclass(frozen=True)
class UnitInput:
    """What one unit computes on one chunk; ``normalizer`` None: the driver normalizes (as Megatron-Core's does)."""

    chunk: Any
    unit: int
    tokens: torch.Tensor
    labels: torch.Tensor
    normalizer: Any


def _leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().requires_grad_(t.requires_grad)


def _kept(keep) -> list:
    if keep is None:
        return []
    return list(keep) if isinstance(keep, tuple) else [keep]


def _leaves(keep):
    return tuple(_leaf(t) for t in keep) if isinstance(keep, tuple) else _leaf(keep)


def _backward(outputs: list[torch.Tensor | None], grads: list[torch.Tensor | None]) -> None:
    pairs = [(o, g) for o, g in zip(outputs, grads) if o is not None and g is not None and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def _grad(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``'s gradient, taken off it: a graph that outlives the node (the routing a dispatcher keeps) keeps ``t``."""
    if t is None:
        return None
    grad, t.grad = t.grad, None
    return grad


def _free(t: torch.Tensor) -> None:
    """Releases the data of a node output that backward does not read (an index_select result)."""
    t.untyped_storage().resize_(0)


def _release_early(t: torch.Tensor, lane) -> None:
    """Frees an all-to-all's output after its consumer, unless a saved tensor shares its storage (``lane.saved``)."""
    if lane.saved is not None and not lane.saved.holds(t):
        _free(t)


class _GradTap(torch.autograd.Function):
    """``value`` as a graph input whose gradient goes to ``holder``: unlike a leaf's, its buffer is kept only by what
    autograd saves (as inside one Megatron-Core node). ``anchor``: an empty leaf that makes the output need grad."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, anchor: torch.Tensor, holder: list) -> torch.Tensor:
        ctx.holder = holder
        return value.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.holder.append(grad)
        return None, None, None


class LayerNodes:
    """The nodes of ``layer`` for one microbatch; ``grad`` False builds no graph. Within a recomputed ``segment`` the
    forward builds no graph and keeps only the segment's input and the exchanged split sizes, which the ``replay_``
    ops reuse so the router routes the same."""

    def __init__(self, layer, index: int, microbatch: int, lane, grad: bool = True, position: int = 0, segment=None):
        self.layer, self.index, self.mb, self.lane, self.grad = layer, index, microbatch, lane, grad
        self.routing = None
        self.owns_comm = layer.owns_comm
        self.position = position  # in the chunk (``index`` is the layer's global number)
        self.segment = segment if grad else None
        # 'moe' recompute (a one-layer segment): the attention keeps its graph; the MoE part replays from its output
        self.moe_replay = self.segment is not None and layer.recomputes_moe
        self._replaying = False
        self._input = self._exchanged = self._rng = None

    _fsdp = None  # Megatron-FSDP's releases of this layer's parameters: (after forward, after backward, wgrad last)

    def set_fsdp_reshard_hooks(self, post_forward, post_backward, after_wgrad: bool = False) -> None:
        """Megatron-FSDP's per-layer releases where Megatron-Core's plan makes them: after the layer's last forward
        node and after its backward (its attention's weight gradients, when delayed). Layers the plan runs whole
        release theirs through FSDP's own module hooks."""
        module = getattr(self.layer, "layer", None)  # the layer run by parts
        if module is not None:
            self._fsdp = (lambda: post_forward(module), lambda: post_backward(module), after_wgrad)

    @property
    def _autograd(self) -> bool:
        """Whether the forward ops now build a graph: a training step's forward, unless it is replayed later."""
        return self.grad and (self.segment is None or self._replaying)

    def _name(self, node: str) -> str:
        return f"replay_{node}" if self._replaying else node

    @property
    def _fused(self) -> bool:
        """This microbatch's tokens move by the layer's own communication (an MoE layer that ``owns_comm``)."""
        return self.owns_comm and self.routing is not None

    def _run_comm(self, fn, op: str) -> Pending:
        return self.lane.run_comm(fn, op=self._name(op), layer=self.index, microbatch=self.mb)

    def _compute(self, node: str):
        return self.lane.compute(self._name(node), self.index, self.mb)

    def _all_to_all(self, tensors, out_splits, in_splits, op: str) -> list[Pending]:
        return [
            self.lane.all_to_all(t, out_splits, in_splits, op=self._name(op), layer=self.index, microbatch=self.mb)
            for t in tensors
        ]

    def compute_pre_dispatch(self, x_in: torch.Tensor) -> None:
        if self.moe_replay:
            self._moe_pre_dispatch(x_in)
            return
        with self._compute("pre_dispatch"):
            self.x = _leaf(x_in)
            if not self._autograd and self.segment is not None and self.segment[0] == self.position:
                self._input = self.x
                if self.lane.saved is not None:
                    self.lane.saved.hold([self._input])
            with torch.set_grad_enabled(self._autograd), self._random_states():
                self.h, self.send, self.keep, self.routing = self.layer.pre_dispatch(self.x)
        self._splits_known, self._exchange = False, None

    def _random_states(self):
        """The first forward of a replayed layer keeps its random states; its replay draws from them again (the
        router's forced load balancing: the same routing), as a checkpoint's recompute does."""
        if self.segment is None:
            return contextlib.nullcontext()
        if not self._replaying:
            self._rng = self.layer.rng_states()
            return contextlib.nullcontext()
        states, self._rng = self._rng, None
        return self.layer.rng_restored(states)

    def _moe_pre_dispatch(self, x_in: torch.Tensor) -> None:
        """The first forward runs the attention with its graph and keeps its output; the MoE part runs without one,
        and again from that output when replayed (``x_in`` is then that output)."""
        with self._compute("pre_dispatch"):
            if self._replaying:
                h = x_in
            else:
                self.x = _leaf(x_in)
                with torch.set_grad_enabled(self.grad):
                    h = self._input = self.layer.attention(self.x)
                if self.lane.saved is not None:
                    self.lane.saved.hold([h])
            with torch.set_grad_enabled(self._autograd), self._random_states():
                self.h, self.send, self.keep, self.routing = self.layer.moe_pre_dispatch(
                    h if self._replaying else h.detach()
                )
        self._splits_known, self._exchange = False, None

    def launch_split(self) -> None:
        """Sends the split sizes without blocking: they travel while the host computes."""
        if self.routing is not None and not self.owns_comm and self._exchange is None:
            self._exchange = self.lane.record_comm("split_exchange", self.index, self.mb)
            self.layer.start_split_exchange(self.routing)

    def wait_split(self) -> None:
        """Finishes the split-size exchange (a host sync), once; an off-host lane leaves it to the dispatch."""
        if self.routing is None or self.owns_comm or self._splits_known or self.lane.launches_off_host:
            return
        self.launch_split()
        self._finish_exchange()

    def _finish_exchange(self) -> tuple[list[int], list[int]]:
        routing = self.routing
        if not self._splits_known:
            record = self._exchange
            record.wait_start_host = time.perf_counter()
            with self.lane.reading(self.index, self.mb):  # waits for this microbatch's compute only
                self.layer.exchange_splits(routing, op=f"{self.layer.name} split exchange (microbatch {self.mb})")
            record.done, record.wait_end_host = self.lane.recorder.clock.mark(), time.perf_counter()
            self._splits_known = True
        return routing.out_splits, routing.in_splits

    def launch_dispatch(self) -> None:
        if self.routing is None:
            self._dispatched = [done(_leaf(t)) for t in self.send]
            return
        if self.owns_comm:
            self._sent = [_leaf(t) for t in self.send]
            routing, sent = self.routing, self._sent

            def dispatch() -> list[torch.Tensor]:
                with torch.set_grad_enabled(self._autograd):
                    return list(self.layer.dispatch_comm(tuple(sent), routing))

            self._dispatched = self._run_comm(dispatch, "dispatch")
            return
        self.launch_split()  # on the host thread, so every rank starts its exchanges in program order
        sent = [t.detach() for t in self.send]
        self._dispatched = self.lane.launch(
            self._finish_exchange, sent, op=self._name("dispatch"), layer=self.index, microbatch=self.mb
        )
        if self.lane.frees_at_launch:  # as Megatron-Core's dispatch node frees its inputs
            self._free_sent()

    def _free_sent(self) -> None:
        if self._frees("moe_dispatch") is not False:  # not a graph's static buffer
            for sent in self.send:
                _free(sent)

    # Each wait drops its Pending: what it holds is the nodes' own from then on, kept only as long as they need it.
    def wait_dispatch(self) -> None:
        dispatched, self._dispatched = self._dispatched, None
        if self._fused:
            self._dispatch_out = dispatched.wait()
            self.received = [_leaf(t) for t in self._dispatch_out]
            return
        self.received = [pending.wait() for pending in dispatched]

    def _frees(self, node: str) -> bool | None:
        """Whether ``node``'s input is freed after its forward by the layer's policy (Megatron-Core's
        ``should_free_input``: ``moe_dispatch``, ``mlp``, ``moe_combine``); None: the layer has none."""
        policy = getattr(self.layer, "frees_input", None)
        return None if policy is None else policy(node)

    def compute_experts(self) -> None:
        received = self.received
        with self._compute("experts"):
            if self.routing is not None and not self.owns_comm:  # a fused dispatch's input may be saved elsewhere
                for sent, got in zip(self.send, received):
                    got.requires_grad_(sent.requires_grad)
                if not self.lane.frees_at_launch:  # else freed when the dispatch was launched
                    self._free_sent()
            with torch.set_grad_enabled(self._autograd):
                self.expert_out = self.layer.experts(tuple(received), self.routing)
            if self.routing is not None:
                frees = self._frees("mlp")
                if frees:
                    _free(received[0])  # the tokens; the probabilities stay, as Megatron-Core keeps them
                for got in received if frees is None else ():
                    _release_early(got, self.lane)

    def launch_combine(self) -> None:
        routing = self.routing
        if routing is None:
            self._combined = done(_leaf(self.expert_out))
            return
        if self.owns_comm:
            self._expert_out_in = expert_out = _leaf(self.expert_out)

            def combine() -> torch.Tensor:
                with torch.set_grad_enabled(self._autograd):
                    return self.layer.combine_comm(expert_out, routing)

            self._combined = self._run_comm(combine, "combine")
            return
        (self._combined,) = self._all_to_all(
            [self.expert_out.detach()], routing.in_splits, routing.out_splits, "combine"
        )
        if self.lane.frees_at_launch:  # as Megatron-Core's combine node frees its input
            _free(self.expert_out)

    def wait_combine(self) -> None:
        self.back, self._combined = self._combined.wait(), None
        if self._fused:
            self._combine_out, self.back = self.back, _leaf(self.back)

    def compute_combine(self) -> torch.Tensor:
        back = self.back
        with self._compute("combine"):
            if self._fused:
                if self._frees("moe_combine") is None:  # a backend may hand the experts' output on as it is
                    _release_early(self.expert_out, self.lane)
            elif self.routing is not None:
                _free(self.expert_out)
                self.back, self._back_grad = None, []
                if self._autograd:
                    back = _GradTap.apply(back, back.new_empty(0).requires_grad_(), self._back_grad)
            self.h_in, self.keep_in = _leaf(self.h), _leaves(self.keep)
            with torch.set_grad_enabled(self._autograd):
                self.out = self.layer.combine(back, self.keep_in, self.h_in, self.routing)
            if self.routing is not None:
                _release_early(back, self.lane)
            if self._fused and self._frees("moe_combine"):
                _free(self.expert_out)
        if self._fsdp is not None:
            self._fsdp[0]()
        if self.grad and not self._autograd:
            return self._forget_forward()
        return self.out

    def _forget_forward(self) -> torch.Tensor:
        out = self.out.requires_grad_(True)
        self._exchanged = None if self.routing is None else self.routing.exchanged
        if not self.moe_replay:  # else the attention's graph from ``x`` waits for the replay's backward
            self.x = None
        self.h = self.send = self.keep = self.h_in = self.keep_in = self.routing = self.out = None
        self.received = self.expert_out = self.back = None
        self._dispatch_out = self._sent = self._expert_out_in = self._combine_out = None
        return out

    def compute_replay_input(self) -> torch.Tensor:
        x, self._input = self._input, None
        if self.lane.saved is not None:
            self.lane.saved.release([x])  # the replay's own ops save it again
        return x

    def compute_replay_pre_dispatch(self, x_in: torch.Tensor) -> None:
        self._replaying = True
        self.compute_pre_dispatch(x_in)
        if self.routing is not None and not self.owns_comm:
            self.layer.replay_splits(self.routing, self._exchanged)
            self._splits_known, self._exchange = True, "replayed"  # no exchange: the first forward's sizes
        self._exchanged = None

    # the same forward ops, named replay_* in the records while _replaying
    launch_replay_dispatch, wait_replay_dispatch = launch_dispatch, wait_dispatch
    compute_replay_experts = compute_experts
    launch_replay_combine, wait_replay_combine = launch_combine, wait_combine

    def compute_replay_combine(self) -> torch.Tensor | None:
        """The replayed output, the next replayed layer's input (None on the segment's last layer)."""
        out = self.compute_combine()
        self._replaying = False
        return None if self.position == self.segment[1] - 1 else out

    def compute_combine_bwd(self, grad_out: torch.Tensor) -> None:
        with self._compute("combine_bwd"):
            _backward([self.out], [grad_out])
        self.out = None

    def launch_combine_bwd(self) -> None:
        routing = self.routing
        grad_back = _grad(self.back) if self.back is not None else next(iter(self._back_grad), None)
        self._back_grad = None
        if routing is None:
            self._combine_grad = done(grad_back)
            return
        if self.owns_comm:
            combined, expert_out = self._combine_out, self._expert_out_in
            self._combine_out = self._expert_out_in = None
            self.lane.used_on_comm([grad_back])  # made by compute, read on the comm stream

            def combine_bwd() -> torch.Tensor:
                _backward([combined], [grad_back])
                return _grad(expert_out)

            self._combine_grad = self._run_comm(combine_bwd, "combine_bwd")
            return
        (self._combine_grad,) = self._all_to_all([grad_back], routing.out_splits, routing.in_splits, "combine_bwd")

    def wait_combine_bwd(self) -> None:
        self._grad_expert_out, self._combine_grad = self._combine_grad.wait(), None

    def compute_experts_bwd(self) -> None:
        with self._compute("experts_bwd"):
            _backward([self.expert_out], [self._grad_expert_out])
        self.expert_out = self.back = self._grad_expert_out = None

    def launch_dispatch_bwd(self) -> None:
        grads = [_grad(t) for t in self.received]
        routing = self.routing
        self.received = None
        if routing is None:
            self._dispatch_grads = [done(g) for g in grads]
            return
        if self.owns_comm:
            dispatched, sent = self._dispatch_out, self._sent
            self._dispatch_out = self._sent = None
            self.lane.used_on_comm(grads)

            def dispatch_bwd() -> list[torch.Tensor | None]:
                _backward(dispatched, grads)
                return [_grad(t) for t in sent]

            self._dispatch_grads = self._run_comm(dispatch_bwd, "dispatch_bwd")
            return
        present = [g for g in grads if g is not None]
        launched = iter(self._all_to_all(present, routing.in_splits, routing.out_splits, "dispatch_bwd"))
        self._dispatch_grads = [None if g is None else next(launched) for g in grads]

    def wgrad_experts(self) -> None:
        with self._compute("expert_wgrad"):
            self.layer.expert_backward_dw()

    def wait_dispatch_bwd(self) -> None:
        grads, self._dispatch_grads = self._dispatch_grads, None
        if self._fused:  # a unit's own dispatch: one backward for all its inputs
            self._grad_send = grads.wait()
            return
        self._grad_send = [None if p is None else p.wait() for p in grads]

    def compute_pre_dispatch_bwd(self) -> torch.Tensor:
        with self._compute("pre_dispatch_bwd"):
            kept, kept_grads = _kept(self.keep), [_grad(t) for t in _kept(self.keep_in)]
            _backward([self.h, *self.send, *kept], [_grad(self.h_in), *self._grad_send, *kept_grads])
        grad_in = _grad(self.x)
        self.x = self.h = self.send = self.keep = self.h_in = self.keep_in = self.routing = self._grad_send = None
        if self._fsdp is not None and not self._fsdp[2]:
            self._fsdp[1]()
        return grad_in

    def wgrad_attention(self) -> None:
        with self._compute("attention_wgrad"):
            self.layer.attention_backward_dw()
        if self._fsdp is not None and self._fsdp[2]:
            self._fsdp[1]()


class ChunkIO:
    """Where a pipeline chunk's input comes from and its outputs go, set by the driver before each step."""

    def __init__(self):
        self.input: Pending | None = None
        self.grad: Pending | None = None
        self.send_output = self.send_grad = None


class MicrobatchNodes:
    """All nodes of one unit in one model chunk: its two ends and one :class:`LayerNodes` per layer. A driver that
    computes the loss from ``loss`` (Megatron-Core's combined 1F1B) sets ``output_grad`` before the backward."""

    def __init__(self, unit: UnitInput, lane, io: ChunkIO | None = None, grad: bool = True):
        model, microbatch = unit.chunk, unit.unit
        self.model, self.mb, self.lane, self.io, self.grad = model, microbatch, lane, io, grad
        self.tokens, self.labels, self.normalizer = unit.tokens, unit.labels, unit.normalizer
        segments = tuple(getattr(model, "recompute_segments", ()))
        self.layers = [
            LayerNodes(layer, j, microbatch, lane, grad, i, segment_of(segments, i))
            for i, (j, layer) in enumerate(zip(model.layer_numbers, model.layers))
        ]
        self.loss: torch.Tensor | None = None
        self.output_grad: torch.Tensor | None = None

    @property
    def issue(self):
        return self.lane.issue

    def compute_embedding(self) -> torch.Tensor:
        with self.lane.compute("embedding", -1, self.mb), torch.set_grad_enabled(self.grad):
            self.embedded = self.model.embed(self.tokens)
        return self.embedded

    def wait_recv_activation(self) -> torch.Tensor:
        return self.io.input.wait().requires_grad_(self.grad)

    def compute_head(self, x_in: torch.Tensor) -> None:
        with self.lane.compute("head", len(self.layers), self.mb):
            self.head_in = _leaf(x_in)
            with torch.set_grad_enabled(self.grad):
                self.loss = self.model.head_loss(self.head_in, self.labels, self.normalizer, self.tokens)

    def launch_send_activation(self, x: torch.Tensor) -> None:
        self.io.send_output(x)

    def compute_head_bwd(self) -> torch.Tensor:
        with self.lane.compute("head_bwd", len(self.layers), self.mb):
            if self.output_grad is None:
                self.loss.backward()
            else:
                _backward([self.loss], [self.output_grad])
        grad, self.head_in, self.output_grad = _grad(self.head_in), None, None
        return grad

    def wait_recv_grad(self) -> torch.Tensor:
        return self.io.grad.wait()

    def compute_embedding_bwd(self, grad: torch.Tensor) -> None:
        with self.lane.compute("embedding_bwd", -1, self.mb):
            _backward([self.embedded], [grad])
        self.embedded = None

    def launch_send_grad(self, grad: torch.Tensor) -> None:
        self.io.send_grad(grad)
