"""The delayed weight-gradient contract between the engine and a model (the role of DualPipe's WeightGradStore).

A module whose weight gradient the engine may defer (a model lists them with ``layer.delayable_linears()``) has:
    ``name``            for error messages;
    ``delay_wgrad``     settable: the engine turns it on for an overlapped step with delayed wgrad;
    ``pending_wgrads``  deferred wgrads queued and not yet computed;
    ``backward_dw()``   computes the oldest one now (the layer's ``expert_backward_dw``/``attention_backward_dw``
                        call it where the schedule puts the wgrad);
    ``reset_pending()`` drops the queue (after a failed step, so nothing leaks into the next one).

:class:`WeightGradStore` is a FIFO such a module can keep its deferred work in. The engine never looks inside a
module; after every step it calls :func:`check_no_pending_wgrads`, because a wgrad left queued is a lost gradient.
"""

from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

WGRAD_WINDOWS = (1, 2)  # where a paired layer step may put the previous layer's delayed attention wgrad


class DelayableLinear(Protocol):
    name: str
    delay_wgrad: bool

    @property
    def pending_wgrads(self) -> int: ...

    def backward_dw(self) -> None: ...

    def reset_pending(self) -> None: ...


class WeightGradStore:
    """FIFO of deferred weight-gradient work: backward pushes, ``run_next`` computes the oldest."""

    def __init__(self, owner: str):
        self.owner = owner
        self._queue: deque[Callable[[], None]] = deque()

    def push(self, work: Callable[[], None]) -> None:
        self._queue.append(work)

    def run_next(self) -> None:
        if not self._queue:
            raise RuntimeError(f"{self.owner}: backward_dw() called with no delayed wgrad queued")
        self._queue.popleft()()

    def __len__(self) -> int:
        return len(self._queue)

    def clear(self) -> None:
        self._queue.clear()


def check_no_pending_wgrads(linears: Iterable[DelayableLinear]) -> None:
    """Raises naming every module that still holds delayed wgrads (their gradients would be lost)."""
    leftover = [f"{linear.name} ({linear.pending_wgrads} queued)" for linear in linears if linear.pending_wgrads]
    if leftover:
        raise RuntimeError(
            "delayed weight gradients were queued but never computed, so these gradients would be lost: "
            + ", ".join(leftover)
            + ". Every backward with delay_wgrad on must be followed by backward_dw() on the module."
        )
