"""Running a function on N local ranks, each with its own process group.

``run_local_ranks(fn, nprocs, args)`` starts ``nprocs`` processes (``fork`` by default: ~20x cheaper than
``spawn`` when the parent holds no process group), initializes ``torch.distributed`` in each, calls
``fn(rank, world_size, *args)`` and returns every rank's outcome. Results travel back serialized with
``torch.save``, so they may hold tensors.

Nothing waits forever, and nothing that makes progress is cut short:
    * A rank stuck in a collective fails itself at the process-group timeout (and reports it).
    * A rank reports progress with :func:`report_progress` (e.g. once per training step); the parent stops the
      run only when no rank has reported anything for ``stall_timeout_s``. There is no wall-clock cap.
    * A rank that dies without reporting is seen at once; the others are then stopped.
    * Ranks die with the parent (``PR_SET_PDEATHSIG`` on Linux), and every way out of ``run_local_ranks``
      (return, exception, a signal turned into an exception) stops the ranks within about 2 s.
    * What ranks reported with :func:`report_progress` survives a failure: :class:`RankFailure` carries it.
"""

import ctypes
import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class RankOutcome:
    """What one rank returned, or the error it raised (formatted traceback)."""

    rank: int
    result: Any = None
    error: str | None = None


class RankFailure(RuntimeError):
    """One or more ranks raised, died, or made no progress for too long.

    Attributes:
        outcomes: Every rank's outcome.
        progress: Per rank, the payloads it reported with :func:`report_progress` before the failure.
    """

    def __init__(self, outcomes: list[RankOutcome], message: str = "", progress: dict[int, list] | None = None):
        self.outcomes = outcomes
        self.progress = progress or {}
        details = "\n".join(f"--- rank {o.rank} ---\n{o.error}" for o in outcomes if o.error)
        super().__init__(f"{message}\n{details}".strip())


_PROGRESS: tuple[Any, int] | None = None  # (queue, rank) inside a rank started by run_local_ranks


def report_progress(payload: Any = None) -> None:
    """Tells the parent this rank made progress, with a payload it keeps even if the run fails later.

    A no-op outside a rank started by :func:`run_local_ranks` (e.g. under torchrun).
    """
    if _PROGRESS is not None:
        results, rank = _PROGRESS
        results.put(("progress", rank, _dumps(payload)))


def _die_with_parent(parent: int) -> None:
    """Asks Linux to SIGKILL this process when its parent dies, so a killed launcher leaves no orphans."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        return  # not Linux: ranks are still daemons and stopped by every exit path of the parent
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _dumps(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _worker(fn, rank, world, args, backend, init_method, timeout_s, threads, rank_setup, results, parent):
    global _PROGRESS
    _die_with_parent(parent)
    _PROGRESS = (results, rank)
    try:
        if rank_setup is not None:
            rank_setup(rank)
        torch.set_num_threads(threads)
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
        )
        value = fn(rank, world, *args)
        results.put(("result", rank, _dumps(value)))
    except BaseException:  # report anything, including KeyboardInterrupt, to the parent
        results.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local_ranks(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple = (),
    *,
    backend: str = "gloo",
    collective_timeout_s: float = 60.0,
    stall_timeout_s: float | None = None,
    threads_per_rank: int = 1,
    start_method: str = "fork",
    raise_on_error: bool = True,
    rank_setup: Callable[[int], None] | None = None,
    master_addr: str = "127.0.0.1",
    on_progress: Callable[[int, Any], None] | None = None,
) -> list[RankOutcome]:
    """Runs ``fn(rank, nprocs, *args)`` on ``nprocs`` local ranks and returns their outcomes, ordered by rank.

    Args:
        fn: Module-level function (picklable for ``spawn``).
        nprocs: Number of ranks.
        args: Extra arguments for ``fn``.
        backend: "gloo" (CPU) or "nccl".
        collective_timeout_s: Process-group timeout for every collective.
        stall_timeout_s: Stop the run when no rank has reported progress or finished for this long (default:
            :func:`default_stall_timeout` of the collective timeout).
        threads_per_rank: ``torch.set_num_threads`` in each rank.
        start_method: "fork" or "spawn".
        raise_on_error: Raise :class:`RankFailure` when any rank failed (else return the outcomes).
        rank_setup: Called in each rank's process before the process group starts (e.g. to enter a network
            namespace and set GLOO_SOCKET_IFNAME).
        master_addr: Address where rank 0 listens for the rendezvous (reachable from every rank).
        on_progress: Called in the parent with ``(rank, payload)`` for every :func:`report_progress`, as it
            arrives (so a caller keeps it even when the run is interrupted).
    """
    stall_timeout_s = stall_timeout_s or default_stall_timeout(collective_timeout_s)
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    init_method = f"tcp://{master_addr}:{free_port()}"
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                fn,
                rank,
                nprocs,
                args,
                backend,
                init_method,
                collective_timeout_s,
                threads_per_rank,
                rank_setup,
                results,
                os.getpid(),
            ),
            daemon=True,
        )
        for rank in range(nprocs)
    ]
    for proc in procs:
        proc.start()
    outcomes: dict[int, RankOutcome] = {}
    progress: dict[int, list] = {rank: [] for rank in range(nprocs)}
    last_news, stalled, give_up_at = time.monotonic(), None, None
    try:
        while len(outcomes) < nprocs and (give_up_at is None or time.monotonic() < give_up_at):
            try:
                kind, rank, payload = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in outcomes]
                if dead and results.empty() and give_up_at is None:
                    for rank in dead:
                        outcomes[rank] = RankOutcome(
                            rank, None, f"rank {rank} died without reporting (exit code {procs[rank].exitcode})"
                        )
                    break
                if time.monotonic() - last_news > stall_timeout_s:
                    stalled = time.monotonic() - last_news
                    break
                continue
            last_news = time.monotonic()
            if kind == "progress":
                progress[rank].append(_loads(payload))
                if on_progress is not None:
                    on_progress(rank, progress[rank][-1])
            elif kind == "result":
                outcomes[rank] = RankOutcome(rank, _loads(payload))
            else:
                outcomes[rank] = RankOutcome(rank, None, payload)
                # Peers of a failed rank fail at their next collective, within one timeout: collect their reasons.
                give_up_at = give_up_at or time.monotonic() + collective_timeout_s + 5
    finally:
        _stop(procs)
    for rank in range(nprocs):
        if rank not in outcomes:
            reason = (
                f"no rank reported progress for {stalled:.0f} s (stall timeout {stall_timeout_s:.0f} s)"
                if stalled is not None
                else "stopped when another rank failed"
            )
            outcomes[rank] = RankOutcome(rank, None, f"rank {rank}: {reason}")
    ordered = [outcomes[rank] for rank in range(nprocs)]
    if raise_on_error and any(o.error for o in ordered):
        raise RankFailure(ordered, f"{sum(1 for o in ordered if o.error)} of {nprocs} ranks failed", progress)
    return ordered


def default_stall_timeout(collective_timeout_s: float) -> float:
    """How long a run may go without any rank reporting progress: 10 collective timeouts.

    A rank blocked in one collective fails itself after one collective timeout; this is the backstop for a rank
    that is stuck elsewhere, generous enough for a step made of many slow collectives.
    """
    return 10 * collective_timeout_s


def _loads(payload: bytes) -> Any:
    return torch.load(io.BytesIO(payload), weights_only=False)


def _stop(procs: list) -> None:
    """Lets finished ranks exit, stops the rest: terminate, then kill what is still there after ~2 s."""
    deadline = time.monotonic() + 2.0
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()) / 2)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def launched_by_torchrun() -> bool:
    """True inside a process started by torchrun (or any launcher that sets the env:// variables)."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
