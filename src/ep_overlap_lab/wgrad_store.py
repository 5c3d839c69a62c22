"""What a lab model keeps its deferred weight gradients in, and what the engine checks of a model's contract.

:class:`DelayableLinear` a module whose weight gradient the engine may defer (the role of TE's
                         ``delay_wgrad_compute`` and DualPipe's WeightGradStore), with
                         :class:`WeightGradStore` the FIFO such a module can keep its deferred work in
:class:`DiscardedStorage` how a model tells the engine's activation count it freed a saved tensor's storage
:func:`check_contract`, :func:`check_no_pending_wgrads`  what the engine checks when built and after a step
"""

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from megatron.bridge.training.ep_overlap.contract import ChunkHooks, LayerHooks


def check_contract(chunks: list) -> None:
    """Every chunk inherits :class:`ChunkHooks` and every layer :class:`LayerHooks` (the engine calls their hooks
    without asking whether they are there).

    Raises:
        TypeError: Naming the class that does not, and the fix.
    """
    for chunk in chunks:
        if not isinstance(chunk, ChunkHooks):
            raise TypeError(
                f"{type(chunk).__name__}: a model chunk the engine runs inherits "
                "megatron.bridge.training.ep_overlap.contract.ChunkHooks (its hooks, with no-op defaults); fix: add "
                "it to the class's bases"
            )
        for layer in chunk.layers:
            if not isinstance(layer, LayerHooks):
                raise TypeError(
                    f"{type(layer).__name__}: a layer the engine runs inherits "
                    "megatron.bridge.training.ep_overlap.contract.LayerHooks; fix: add it to the class's bases"
                )


class DelayableLinear(Protocol):
    """``delay_wgrad`` is set by the engine for an overlapped step with delayed wgrad; ``backward_dw()`` computes
    the oldest deferred wgrad (the layer's ``expert_backward_dw``/``attention_backward_dw`` call it where the
    schedule puts it); ``reset_pending()`` drops the queue after a failed step."""

    name: str
    delay_wgrad: bool

    @property
    def pending_wgrads(self) -> int: ...

    def backward_dw(self) -> None: ...

    def reset_pending(self) -> None: ...


class WeightGradStore:
    """FIFO of deferred weight-gradient work: backward pushes, ``run_next`` computes the oldest.

    ``held`` names the tensors a work keeps alive until it runs; every object in the class-level ``observers``
    hears of them (``hold(held)`` on push, ``release(held)`` when the work ran or was dropped): the engine counts
    them as memory the schedule holds for backward.
    """

    observers: list = []

    def __init__(self, owner: str):
        self.owner = owner
        self._queue: deque[tuple[Callable[[], None], tuple]] = deque()

    def push(self, work: Callable[[], None], held: tuple = ()) -> None:
        self._queue.append((work, held))
        for observer in WeightGradStore.observers:
            observer.hold(held)

    def run_next(self) -> None:
        if not self._queue:
            raise RuntimeError(f"{self.owner}: backward_dw() called with no delayed wgrad queued")
        work, held = self._queue.popleft()
        work()
        self._released(held)

    def _released(self, held: tuple) -> None:
        for observer in WeightGradStore.observers:
            observer.release(held)

    def __len__(self) -> int:
        return len(self._queue)

    def clear(self) -> None:
        while self._queue:
            self._released(self._queue.popleft()[1])


class DiscardedStorage:
    """A model may free the storage of a tensor some op saved for backward and rebuild it before that op's backward
    (recompute without keeping the output, as Megatron-Core's ``CheckpointWithoutOutput``). It tells every object in
    ``observers`` (the engine's activation count), so the bytes held stay exact: ``discard(tensor)`` before the
    storage is freed returns a token; ``restore(token)`` once it holds data again."""

    observers: list = []

    @classmethod
    def discard(cls, tensor: Any) -> list:
        return [observer.discard(tensor) for observer in cls.observers]

    @classmethod
    def restore(cls, token: list) -> None:
        for observer, key in zip(cls.observers, token):
            observer.restore(key)


def check_no_pending_wgrads(linears: Iterable[DelayableLinear]) -> None:
    """Raises naming every module that still holds delayed wgrads (their gradients would be lost)."""
    leftover = [f"{linear.name} ({linear.pending_wgrads} queued)" for linear in linears if linear.pending_wgrads]
    if leftover:
        raise RuntimeError(
            "delayed weight gradients were queued but never computed, so these gradients would be lost: "
            + ", ".join(leftover)
            + ". Every backward with delay_wgrad on must be followed by backward_dw() on the module."
        )
