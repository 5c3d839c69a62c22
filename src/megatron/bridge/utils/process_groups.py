"""Expert-parallel process groups (:class:`EPGroups`) and collectives that never wait forever. Split-size exchanges
run on ``ep_meta_group`` (gloo, CPU tensors) so they never queue behind bulk all-to-alls; every wait goes through
:func:`wait_work` under the groups' timeout, so a rank whose peer died raises :class:`CollectiveError` instead of
hanging (or, with a peer check installed, the reason a peer posted for stopping); finished waits and compute nodes
call :func:`tell_alive`, a no-op unless a launcher installed a listener."""

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_alive_listener: Callable[..., None] | None = None
_peer_check: Callable[[], None] | None = None
PEER_POLL = timedelta(seconds=0.5)  # how often a long wait asks whether a peer gave up (one store read)


def set_alive_listener(listener: Callable[..., None] | None) -> None:
    """Installs (None: removes) the function :func:`tell_alive` calls in this process."""
    global _alive_listener
    _alive_listener = listener


def tell_alive(what: str, *args) -> None:
    """This process just finished ``what % args`` (formatted by the listener, only when it needs the text)."""
    if _alive_listener is not None:
        _alive_listener(what, *args)


class CollectiveError(RuntimeError):
    """A collective failed or did not finish within the timeout; the message names the rank and the op."""


@dataclass
class EPGroups:
    """Process groups one rank uses. With ``ep_size == 1`` and no process group every group is None."""

    ep_size: int
    ep_rank: int
    ep_group: dist.ProcessGroup | None
    ep_meta_group: dist.ProcessGroup | None
    expert_dp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    timeout: timedelta
    pp_size: int = 1
    pp_rank: int = 0
    pp_group: dist.ProcessGroup | None = None
    pp_ranks: tuple[int, ...] = ()  # global rank of each pipeline stage's member of this rank's pp_group


def set_peer_check(check: Callable[[], None] | None) -> None:
    """Installs (None: removes) what :func:`wait_work` calls every :data:`PEER_POLL` of a long wait and when a wait
    fails: it raises the reason a peer posted for stopping (so the wait ends with it), else returns."""
    global _peer_check
    _peer_check = check


def check_peers() -> None:
    """Runs the installed peer check (see :func:`set_peer_check`), if any."""
    if _peer_check is not None:
        _peer_check()


def wait_work(work: dist.Work, *, op: str, timeout: timedelta, polled: bool = True) -> None:
    """Waits for an async collective; raises CollectiveError naming this rank and ``op`` on failure or timeout, or
    what the peer check raises (a peer's reason for stopping, read while waiting or after the failure). ``polled``
    False: one wait for the whole timeout, as a point-to-point send or receive needs (gloo closes the connection of
    one whose wait times out); a peer that dies is still seen at once, its connection closing."""
    completed, error = _wait_polling(work, timeout, polled)
    if error is not None or completed is False:
        check_peers()
    if error is not None:  # gloo/NCCL report peer loss and timeouts as various RuntimeErrors
        raise wait_error(op, timeout, error) from error
    if completed is False:
        raise wait_error(op, timeout, None)
    tell_alive(op)


def _wait_polling(work: dist.Work, timeout: timedelta, polled: bool) -> tuple[bool | None, Exception | None]:
    """``work.wait(timeout)``, in :data:`PEER_POLL` slices with the peer check between them where one is installed
    (and ``polled``)."""
    if _peer_check is None or not polled or timeout <= PEER_POLL:
        try:
            return work.wait(timeout), None
        except Exception as exc:
            return None, exc
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        left = deadline - time.monotonic()
        try:
            return work.wait(min(PEER_POLL, timedelta(seconds=max(left, 0.0)))), None
        except Exception as exc:
            if work.is_completed():  # it failed, or finished just after the slice ran out: its own outcome
                try:
                    return work.wait(PEER_POLL), None
                except Exception as outcome:
                    return None, outcome
            if left <= PEER_POLL.total_seconds():
                return None, exc  # the whole timeout has passed
        _peer_check()


def wait_error(op: str, timeout: timedelta, cause: Exception | None) -> CollectiveError:
    """The error of a wait for ``op`` that failed (``cause``) or timed out (``cause`` None)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    detail = f": {cause}" if cause is not None else ""
    return CollectiveError(
        f"rank {rank}: {op} did not complete (timeout {timeout.total_seconds():g}s; a peer rank may have failed "
        f"or stopped participating){detail}"
    )


def exchanged_bytes(x: torch.Tensor, out_splits: list[int], in_splits: list[int], rank: int) -> tuple[int, int]:
    """Bytes an all-to-all of ``x`` sends to other ranks and receives from them (the own slice stays local)."""
    row = x[0].numel() * x.element_size() if x.shape[0] else math.prod(x.shape[1:]) * x.element_size()
    return (sum(in_splits) - in_splits[rank]) * row, (sum(out_splits) - out_splits[rank]) * row


def data_parallel_size_of(model_config: Any) -> int:
    """World size over TP x PP x CP when a process group exists, else 1 (what ``data_parallel_size=None`` means)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    model_parallel = 1
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        model_parallel *= getattr(model_config, name, 1) or 1
    return max(1, dist.get_world_size() // model_parallel)


def refuse_together(error: Exception | None) -> None:
    """Every rank refuses when any rank does (one all-gather over the default group, which every rank must call), so
    none waits in a collective for a peer that stopped; ranks without an ``error`` raise naming the first that had."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    said = [None] * dist.get_world_size()
    dist.all_gather_object(said, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    for rank, line in enumerate(said):
        if line is not None:
            raise ValueError(f"rank {rank} refused this model, so every rank does: {line}")
