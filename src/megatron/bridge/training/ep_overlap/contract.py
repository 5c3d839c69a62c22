"""What a model offers the schedule's runtime (no torch here).

A model never imports the runtime: it implements these protocols, and the runtime's nodes drive anything that does.
The Megatron-Core adapter (``ep_overlap/mcore``) does, as does the lab's reference MoE GPT.

    :class:`LayerFunctions`  one transformer layer cut into the schedule's node functions
    :class:`ChunkModel`      a whole model or one pipeline chunk: its layers, its two ends, its loss
    :class:`ChunkHooks`, :class:`LayerHooks`  what the runtime reads besides, with defaults

Losses are token-summed cross-entropies divided by a normalizer the engine passes; labels equal to
:data:`IGNORE_INDEX` count in neither.
"""

from collections.abc import Iterable
from contextlib import nullcontext
from typing import Any, NamedTuple, Protocol

from megatron.bridge.training.ep_overlap.segments import segment_of

IGNORE_INDEX = -100  # a label that counts neither in the loss nor in its token count (PyTorch's convention)


class PreDispatch(NamedTuple):
    """What a layer's ``pre_dispatch`` hands on: the residual ``h`` (to combine), the tensors to ``send`` (the
    dispatch), what it ``keep`` s for combine (None, a tensor or a tuple of tensors) and its ``routing`` (None for a
    dense layer). A tuple, so ``h, send, keep, routing = layer.pre_dispatch(x)`` works too."""

    h: Any
    send: tuple
    keep: Any
    routing: Any


class LayerFunctions(Protocol):
    """One layer's node functions; ``routing`` is None for dense layers and carries ``in_splits``/``out_splits``.

    ``pre_dispatch(x) -> PreDispatch(h, send, keep, routing)``: attention, pre-MLP norm, router, permute; ``send``
    is the tuple of tensors to dispatch, ``keep`` (None, a tensor, or a tuple of tensors) stays on this rank for
    combine, which gets it in the same structure. ``start_split_exchange(routing)`` sends the split
    sizes without blocking (may do nothing); ``exchange_splits(routing, op=...)`` finishes it (or does all of it).
    ``experts(received, routing)``; ``combine(back, keep, h, routing)``: unpermute and residual add.
    ``exchange_splits_off_host`` True lets a CPU lane finish the split exchange on its helper thread (it must then
    touch only the routing and the EP metadata group).

    A layer that moves its own tokens (a backend's fused permute and all-to-all) sets ``owns_comm`` True and gives
    ``dispatch_comm(send, routing) -> received`` and ``combine_comm(expert_out, routing) -> back``, differentiable,
    whose autograd backward is the reverse communication; the engine runs them, and their backward, on its comm
    lane, and its split-size ops do nothing for that layer.
    """

    name: str
    is_moe: bool

    def pre_dispatch(self, x: Any) -> PreDispatch: ...

    def start_split_exchange(self, routing: Any) -> None: ...

    def exchange_splits(self, routing: Any, *, op: str) -> None: ...

    def experts(self, received: tuple, routing: Any) -> Any: ...

    def combine(self, back: Any, keep: Any, h: Any, routing: Any) -> Any: ...

    def delayable_linears(self) -> list: ...

    def expert_backward_dw(self) -> None: ...

    def attention_backward_dw(self) -> None: ...


class ChunkModel(Protocol):
    """A whole model or one pipeline chunk: ``layers`` with their global ``layer_numbers``; ``pre_process`` /
    ``post_process`` whether it holds the embedding / the head; ``sequence_length`` the one it takes (None: any);
    ``embed(tokens)`` and ``head_loss(x, labels, normalizer, tokens)`` where it does (``tokens``: the microbatch's
    input, for a head that reads it, as multi-token prediction does); ``hidden_shape(tokens)`` of the activation
    between chunks; a whole model also a plain ``__call__(tokens, labels, normalizer)``.

    A chunk class also inherits :class:`ChunkHooks` (the hooks the engine calls on every chunk, with no-op
    defaults), and each of its layers :class:`LayerHooks`."""

    config: Any
    vocab_size: int
    sequence_length: int | None
    layers: list
    layer_numbers: list[int]
    pre_process: bool
    post_process: bool

    def parameters(self) -> Iterable: ...

    def embed(self, tokens: Any) -> Any: ...

    def head_loss(self, x: Any, labels: Any, normalizer: float | None, tokens: Any) -> Any: ...


class ChunkHooks:
    """The hooks the engine calls on every chunk besides :class:`ChunkModel`'s functions, declared once with no-op
    defaults; a chunk class inherits this and overrides what it needs."""

    sequence_length: int | None = None  # the sequence length the chunk takes (None: any)
    # Full recompute: the chunk's layer segments ``(first, stop)`` whose forward keeps only its input and is replayed
    # in backward (``segments.py``); the plain path is ``run_layers``'s.
    recompute_segments: tuple[tuple[int, int], ...] = ()

    def run_layers(self, x: Any) -> Any:
        """The plain path through the chunk's layers (ordinary autograd); each of ``recompute_segments`` runs as
        :meth:`run_segment` checkpoints it."""
        j = 0
        while j < len(self.layers):
            segment = segment_of(self.recompute_segments, j)
            x, j = (self.layers[j](x), j + 1) if segment is None else (self.run_segment(*segment, x), segment[1])
        return x

    def run_segment(self, first: int, stop: int, x: Any) -> Any:
        """Layers ``first`` to ``stop`` (exclusive) of the plain path, keeping only ``x`` for backward and running
        them again there (a chunk with ``recompute_segments`` gives its checkpoint)."""
        raise NotImplementedError(f"{type(self).__name__}: recompute_segments given, run_segment not")

    def step_context(self) -> Any:
        """A context the engine enters around each overlapped step of the program (the plain path's whole-chunk
        call enters its own): Megatron-Core's fp8 delayed scaling opens one around a whole stack."""
        return nullcontext()

    def with_packed_sequences(self, packed_seq_params: Any) -> "ChunkModel":
        """This chunk for one packed (THD) microbatch (the engine's ``(tokens, labels, packed_seq_params)``): a view
        whose attention reads the document boundaries. By default refused: the model must run THD itself."""
        raise ValueError(
            f"{type(self).__name__}: packed (THD) microbatches need a model whose attention runs them; fix: pad the "
            "sequences and pass (tokens, labels), or run a Megatron-Core model (ep_overlap.mcore.chunk_for)"
        )


class LayerHooks:
    """What the engine reads on every layer besides :class:`LayerFunctions`, with its defaults; a layer class
    inherits this and sets what differs."""

    owns_comm: bool = False  # the layer's own functions run its all-to-alls (a fused dispatcher's), not the lane
    exchange_splits_off_host: bool = False  # exchange_splits touches only its routing and the EP metadata group, so
    # a lane may run it off the host thread
    replays_forward: bool = False  # full recompute: the engine may replay the layer's forward in backward; then
    # ``replay_splits(routing, exchanged)`` completes a replayed routing with the split sizes its first forward
    # exchanged (``routing.exchanged``), without communicating
