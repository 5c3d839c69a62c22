"""What a model offers the schedule's runtime (no torch here): it implements these protocols and never imports the
runtime. Losses are token-summed cross-entropies divided by the engine's normalizer; labels equal to
:data:`IGNORE_INDEX` count in neither."""

from collections.abc import Iterable
from contextlib import nullcontext
from typing import Any, NamedTuple, Protocol

IGNORE_INDEX = -100


def segment_of(segments: tuple[tuple[int, int], ...], layer: int) -> tuple[int, int] | None:
    """The full-recompute segment that holds ``layer`` (a position in the chunk), or None."""
    return next((s for s in segments if s[0] <= layer < s[1]), None)


class PreDispatch(NamedTuple):
    """What ``pre_dispatch`` hands on: residual ``h``, tensors to ``send``, what it ``keep`` s for combine (None, a
    tensor or a tuple) and its ``routing`` (None: dense)."""

    h: Any
    send: tuple
    keep: Any
    routing: Any


class LayerFunctions(Protocol):
    """One layer's node functions; ``routing`` is None for dense layers and carries ``in_splits``/``out_splits``.
    ``keep`` reaches ``combine`` in the structure ``pre_dispatch`` gave it; ``start_split_exchange`` sends the split
    sizes without blocking and ``exchange_splits`` finishes it. A layer that ``owns_comm`` gives differentiable
    ``dispatch_comm(send, routing)`` and ``combine_comm(expert_out, routing)``; its split-size ops do nothing."""

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
    """A whole model or one pipeline chunk, with ``hidden_shape(tokens)`` between chunks; ``head_loss`` gets ``tokens``
    for a head that reads them (MTP); a whole model is also called as ``(tokens, labels, normalizer)``."""

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
    """The engine's hooks on every chunk besides :class:`ChunkModel`'s functions, with no-op defaults."""

    sequence_length: int | None = None
    # Full recompute: segments ``(first, stop)`` whose forward keeps only its input and is replayed in backward
    recompute_segments: tuple[tuple[int, int], ...] = ()

    def run_layers(self, x: Any) -> Any:
        """The plain path through the layers, each recompute segment via :meth:`run_segment`."""
        j = 0
        while j < len(self.layers):
            segment = segment_of(self.recompute_segments, j)
            x, j = (self.layers[j](x), j + 1) if segment is None else (self.run_segment(*segment, x), segment[1])
        return x

    def run_segment(self, first: int, stop: int, x: Any) -> Any:
        """Layers ``first`` to ``stop`` (exclusive), checkpointed: keeps only ``x`` and reruns them in backward."""
        raise NotImplementedError(f"{type(self).__name__}: recompute_segments given, run_segment not")

    def step_context(self) -> Any:
        """A context the engine enters around each overlapped step (the plain path's call enters its own)."""
        return nullcontext()

    def with_packed_sequences(self, packed_seq_params: Any) -> "ChunkModel":
        """This chunk for one packed (THD) microbatch; refused by default."""
        raise ValueError(
            f"{type(self).__name__}: packed (THD) microbatches need a model whose attention runs them; fix: pad the "
            "sequences and pass (tokens, labels), or run a Megatron-Core model (ep_overlap.mcore.chunk_for)"
        )


class LayerHooks:
    """What the engine reads on every layer besides :class:`LayerFunctions`, with defaults."""

    owns_comm: bool = False  # the layer's own functions run its all-to-alls (a fused dispatcher's), not the lane
    # exchange_splits touches only its routing and the EP metadata group: a lane may run it off the host thread
    exchange_splits_off_host: bool = False
    # full recompute may replay the forward; ``replay_splits(routing, exchanged)`` then reuses its first split sizes
    replays_forward: bool = False
    # 'moe' in recompute_modules: a one-layer recompute segment whose replay starts at the attention's output
    # (``attention(x)`` and ``moe_pre_dispatch(h)`` split ``pre_dispatch``)
    recomputes_moe: bool = False

    def rng_states(self) -> Any:
        """The random states a replayed forward starts from (None: the layer draws nothing to replay)."""
        return None

    def rng_restored(self, states: Any) -> Any:
        """A context in which the replay draws what the first forward drew from ``states``, leaving the step's own
        random states as they were."""
        return nullcontext()
