"""The nodes of one transformer layer for one microbatch, each its own autograd segment.

A node's inputs are detached from the previous node's outputs (keeping their ``requires_grad``), so each node
can be back-propagated on its own: backward of a node runs ``torch.autograd.backward(outputs, grads)`` and
hands the gradients of its detached inputs to the node before it.

    node          lane     forward                                   backward
    pre_dispatch  compute  attention, pre-MLP norm, router, permute  dgrad (+ attention wgrad, deferred if delayed)
    dispatch      comm     split-size exchange, all-to-all          reverse all-to-all
    experts       compute  sort by local expert, grouped GEMMs       dgrad (+ expert wgrad, deferred if delayed)
    combine       comm     all-to-all back, unpermute, residual add  unpermute backward, reverse all-to-all

Comm nodes are split in a launch (issue the all-to-all) and a wait (in the consumer), so the schedule can put
the other microbatch's compute in between. Dense layers run the same nodes with no communication.

Bitwise equality with the plain path holds because every node runs exactly the ops of
``TransformerLayer.forward``, and every tensor that crosses a node boundary and has two gradient contributions
(the residual ``h``) gets them summed in one addition, which is exact whatever the order.
"""

import time

import torch

from megatron.bridge.training.ep_overlap.lanes import Pending, done


def _leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    """A node input: cut from the producer's graph, keeping whether it needs a gradient."""
    return None if t is None else t.detach().requires_grad_(t.requires_grad)


def _backward(outputs: list[torch.Tensor | None], grads: list[torch.Tensor | None]) -> None:
    pairs = [(o, g) for o, g in zip(outputs, grads) if o is not None and g is not None and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def _grad(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.grad


def _free(t: torch.Tensor) -> None:
    """Releases the data of a node output that backward does not read (an index_select result)."""
    t.untyped_storage().resize_(0)


class LayerNodes:
    """The four nodes of ``layer`` for one microbatch, in forward and backward halves.

    ``layer`` provides the node functions (the reference ``TransformerLayer`` does, and so does the Megatron-Core
    adapter): ``is_moe``; ``pre_dispatch(x) -> (h, send, keep, routing)`` where ``send`` is the tuple of tensors to
    dispatch and ``keep`` stays on this rank for combine; ``start_split_exchange(routing)`` (send the split sizes
    without blocking; may do nothing) and ``exchange_splits(routing, op=...)`` (finish, or do all of it);
    ``experts(received, routing)``; ``combine(back, keep, h, routing)``; ``expert_backward_dw()`` and
    ``attention_backward_dw()``. ``routing`` is None for dense layers and carries ``in_splits``/``out_splits``.
    With ``grad`` False (a forward-only step) the nodes build no autograd graph. A layer with
    ``exchange_splits_off_host`` True lets a CPU lane finish its split exchange on the lane's helper thread
    (:mod:`~megatron.bridge.training.ep_overlap.lanes`): its ``exchange_splits`` then must touch only the routing
    and the EP metadata group.
    """

    def __init__(self, layer, index: int, microbatch: int, lane, delay_wgrad: bool, grad: bool = True):
        self.layer, self.index, self.mb, self.lane = layer, index, microbatch, lane
        self.delay_wgrad, self.grad = delay_wgrad, grad
        self.routing = None

    def _compute(self, node: str):
        return self.lane.compute(node, self.index, self.mb)

    def _all_to_all(self, tensors, out_splits, in_splits, op: str) -> list[Pending]:
        return [
            self.lane.all_to_all(t, out_splits, in_splits, op=op, layer=self.index, microbatch=self.mb)
            for t in tensors
        ]

    # ---- forward ------------------------------------------------------------------------------------

    def pre_dispatch(self, x_in: torch.Tensor) -> None:
        with self._compute("pre_dispatch"):
            self.x = _leaf(x_in)
            with torch.set_grad_enabled(self.grad):
                self.h, self.send, self.keep, self.routing = self.layer.pre_dispatch(self.x)
        self._splits_known, self._exchange = False, None

    @property
    def is_moe(self) -> bool:
        return self.layer.is_moe

    def start_exchange(self) -> None:
        """Sends the split sizes ahead, without blocking the host (a schedule calls it as soon as routing is known,
        so they travel, and a slower peer catches up, while the host computes something else)."""
        if self.routing is not None and self._exchange is None:
            self._exchange = self.lane.record_comm("split_exchange", self.index, self.mb)
            self.layer.start_split_exchange(self.routing)

    def exchange_splits(self) -> None:
        """Finishes the split-size exchange (a host sync), once: ``dispatch`` runs it, all of it unless started.
        On a lane that launches off the host it is left to the dispatch's launch, on the helper thread."""
        if self.routing is None or self._splits_known or self.lane.launches_off_host:
            return
        self.start_exchange()
        self._finish_exchange()

    def _finish_exchange(self) -> tuple[list[int], list[int]]:
        """Waits for the split sizes (on the host or on the lane's helper thread); returns the dispatch's splits."""
        routing = self.routing
        if not self._splits_known:
            record = self._exchange
            record.wait_start_host = time.perf_counter()
            self.layer.exchange_splits(routing, op=f"{self.layer.name} split exchange (microbatch {self.mb})")
            record.done, record.wait_end_host = self.lane.recorder.clock.mark(), time.perf_counter()
            self._splits_known = True
        return routing.out_splits, routing.in_splits

    def dispatch(self) -> None:
        """Launch. The split-size exchange sits here unless done before, after this microbatch's compute is issued."""
        if self.routing is None:
            self._dispatched = [done(_leaf(t)) for t in self.send]
            return
        self.start_exchange()  # on the host thread, so every rank starts its exchanges in program order
        sent = [t.detach() for t in self.send]
        self._dispatched = self.lane.launch(
            self._finish_exchange, sent, op="dispatch", layer=self.index, microbatch=self.mb
        )

    def experts(self) -> None:
        received = [pending.wait() for pending in self._dispatched]
        with self._compute("experts"):
            if self.routing is not None:
                for sent, got in zip(self.send, received):
                    _free(sent)
                    got.requires_grad_(sent.requires_grad)
            self.received = received
            with torch.set_grad_enabled(self.grad):
                self.expert_out = self.layer.experts(tuple(received), self.routing)

    def combine(self) -> None:
        """Launch."""
        routing = self.routing
        if routing is None:
            self._combined = done(_leaf(self.expert_out))
            return
        (self._combined,) = self._all_to_all(
            [self.expert_out.detach()], routing.in_splits, routing.out_splits, "combine"
        )

    def combine_finish(self) -> torch.Tensor:
        """Wait for the combine all-to-all, then unpermute and add the residual. Returns the layer output."""
        back = self._combined.wait()
        with self._compute("combine"):
            if self.routing is not None:
                _free(self.expert_out)
                back.requires_grad_(self.grad)
            self.back, self.h_in, self.keep_in = back, _leaf(self.h), _leaf(self.keep)
            with torch.set_grad_enabled(self.grad):
                self.out = self.layer.combine(back, self.keep_in, self.h_in, self.routing)
        return self.out

    # ---- backward -----------------------------------------------------------------------------------

    def combine_backward(self, grad_out: torch.Tensor) -> None:
        """Unpermute backward, then launch the reverse all-to-all."""
        with self._compute("combine_bwd"):
            _backward([self.out], [grad_out])
        self.out = None
        grad_back = self.back.grad
        routing = self.routing
        if routing is None:
            self._combine_grad = done(grad_back)
            return
        (self._combine_grad,) = self._all_to_all([grad_back], routing.out_splits, routing.in_splits, "combine_bwd")

    def experts_backward(self) -> None:
        """Expert dgrad (and wgrad, unless delayed)."""
        grad_out = self._combine_grad.wait()
        with self._compute("experts_bwd"):
            _backward([self.expert_out], [grad_out])
        self.expert_out = self.back = None

    def dispatch_backward(self) -> None:
        """Launch the reverse all-to-all of the experts' input gradients."""
        grads = [_grad(t) for t in self.received]
        routing = self.routing
        self.received = None
        if routing is None:
            self._dispatch_grads = [done(g) for g in grads]
            return
        present = [g for g in grads if g is not None]
        launched = iter(self._all_to_all(present, routing.in_splits, routing.out_splits, "dispatch_bwd"))
        self._dispatch_grads = [None if g is None else next(launched) for g in grads]

    def expert_wgrad(self) -> None:
        """Delayed expert weight gradients; the schedule runs this while dispatch backward is in flight."""
        if self.delay_wgrad and self.layer.is_moe:
            with self._compute("expert_wgrad"):
                self.layer.expert_backward_dw()

    def pre_dispatch_backward(self) -> torch.Tensor:
        """Attention/router/norm dgrad (attention wgrad too, unless delayed). Returns the layer input's gradient."""
        grad_send = [None if p is None else p.wait() for p in self._dispatch_grads]
        with self._compute("pre_dispatch_bwd"):
            _backward([self.h, *self.send, self.keep], [self.h_in.grad, *grad_send, _grad(self.keep_in)])
        grad_in = self.x.grad
        self.x = self.h = self.send = self.keep = self.h_in = self.keep_in = self.routing = None
        return grad_in

    def attention_wgrad(self) -> None:
        """Delayed attention weight gradients; the schedule runs this after attention dgrad."""
        if self.delay_wgrad:
            with self._compute("attention_wgrad"):
                self.layer.attention_backward_dw()

    # ---- unpaired ---------------------------------------------------------------------------------------

    def forward(self, x_in: torch.Tensor) -> torch.Tensor:
        self.pre_dispatch(x_in)
        self.dispatch()
        self.experts()
        self.combine()
        return self.combine_finish()

    def backward(self, grad_out: torch.Tensor) -> torch.Tensor:
        self.combine_backward(grad_out)
        self.experts_backward()
        self.dispatch_backward()
        self.expert_wgrad()
        grad_in = self.pre_dispatch_backward()
        self.attention_wgrad()
        return grad_in


class ChunkIO:
    """Where a pipeline chunk's input comes from and its outputs go (set by the driver before each step).

    ``input``/``grad``: the received activation / output gradient (a :class:`Pending`); ``send_output``/
    ``send_grad``: callables that start sending the chunk's output activation / input gradient.
    """

    def __init__(self):
        self.input: Pending | None = None
        self.grad: Pending | None = None
        self.send_output = self.send_grad = None


class MicrobatchNodes:
    """All nodes of one microbatch in one model chunk: the chunk's start, its layers' nodes, and its end.

    ``model`` provides ``layers`` (each with the node functions above) and their global ``layer_numbers``,
    ``pre_process``/``post_process`` (whether it is the model's first/last chunk; both for a whole model), and where
    it is the first chunk ``embed(tokens)``, where it is the last
    ``head_loss(x, labels, normalizer)``: the reference ``MoEGPTModel`` does, and so does the Megatron-Core plan.
    Other chunks receive their input and output gradient and send theirs through ``io`` (:class:`ChunkIO`).

    With ``grad`` False (a forward-only step) nothing builds an autograd graph.

    ``loss`` is the head's output. It is the scalar loss, unless a driver computes the loss from it (Megatron-Core's
    combined 1F1B does: the head then returns per-token losses); such a driver sets ``output_grad``, the gradient
    of the head's output, before the backward starts.
    """

    def __init__(
        self,
        model,
        microbatch: int,
        tokens,
        labels,
        normalizer: float | None,
        lane,
        delay_wgrad: bool,
        io: ChunkIO | None = None,
        grad: bool = True,
    ):
        self.model, self.mb, self.lane, self.io = model, microbatch, lane, io
        self.grad = grad
        self.tokens, self.labels, self.normalizer = tokens, labels, normalizer
        self.first, self.last = model.pre_process, model.post_process
        self.layers = [
            LayerNodes(layer, j, microbatch, lane, delay_wgrad, grad)
            for j, layer in zip(model.layer_numbers, model.layers)
        ]
        self.loss: torch.Tensor | None = None
        self.output_grad: torch.Tensor | None = None

    # ---- the chunk's two ends ----------------------------------------------------------------------------

    def forward_begin(self) -> torch.Tensor:
        """The embedding, or the activation received from the previous pipeline stage."""
        if not self.first:
            return self.io.input.wait().requires_grad_(self.grad)
        with self.lane.compute("embedding", -1, self.mb), torch.set_grad_enabled(self.grad):
            self.embedded = self.model.embed(self.tokens)
        return self.embedded

    def forward_end(self, x_in: torch.Tensor) -> None:
        """Head and loss, or send the activation to the next pipeline stage."""
        if not self.last:
            self.io.send_output(x_in)
            return
        with self.lane.compute("head", len(self.layers), self.mb):
            self.head_in = _leaf(x_in)
            with torch.set_grad_enabled(self.grad):
                self.loss = self.model.head_loss(self.head_in, self.labels, self.normalizer)

    def backward_begin(self) -> torch.Tensor:
        """Loss and head backward, or the output gradient received from the next pipeline stage."""
        if not self.last:
            return self.io.grad.wait()
        with self.lane.compute("head_bwd", len(self.layers), self.mb):
            if self.output_grad is None:
                self.loss.backward()
            else:
                _backward([self.loss], [self.output_grad])
        grad, self.head_in, self.output_grad = self.head_in.grad, None, None
        return grad

    def backward_end(self, grad: torch.Tensor) -> None:
        """Embedding backward, or send the input gradient to the previous pipeline stage."""
        if not self.first:
            self.io.send_grad(grad)
            return
        with self.lane.compute("embedding_bwd", -1, self.mb):
            _backward([self.embedded], [grad])
        self.embedded = None

    # ---- unpaired -----------------------------------------------------------------------------------------

    def forward(self) -> None:
        x = self.forward_begin()
        for layer in self.layers:
            x = layer.forward(x)
        self.forward_end(x)

    def backward(self) -> None:
        grad = self.backward_begin()
        for layer in reversed(self.layers):
            grad = layer.backward(grad)
        self.backward_end(grad)
