"""Running a function on N local ranks, each with its own process group.

``run_local_ranks(fn, nprocs, args)`` starts ``nprocs`` processes (``fork`` by default: ~20x cheaper than
``spawn`` when the parent holds no process group), initializes ``torch.distributed`` in each, calls
``fn(rank, world_size, *args)`` and returns every rank's outcome. Results travel back serialized with
``torch.save``, so they may hold tensors.

Nothing waits forever, and nothing that makes progress is cut short:
    * A rank stuck in a collective fails itself at the process-group timeout (and reports it).
    * A rank reports progress with :func:`report_progress` (e.g. once per training step), and says it is alive
      with :func:`heartbeat` whenever a collective or a compute node finishes (at most twice a second; each rank
      installs it as ``process_groups``' alive listener, which its collective waits and the runtime's nodes call).
      The parent stops the run only when no rank has said anything for ``stall_timeout_s``, naming what each rank
      last finished. There is no wall-clock cap.
      Start-up is not silence: the stall clock runs once every rank has its process group up (it says so); a rank
      that never gets there fails itself at the rendezvous's timeout, the collective timeout.
    * A rank that dies is seen within a second, whatever else has happened (another rank's error included), and
      is reported first, with its exit signal; the others are stopped a second later.
    * Ranks ignore SIGINT: the parent decides. Ranks die with the parent (``PR_SET_PDEATHSIG`` on Linux), and
      every way out of ``run_local_ranks`` (return, exception, a signal turned into an exception) stops the ranks
      within about 2 s. An interrupt that comes when ``finish_after_interrupt()`` says the ranks have nothing left
      but to return lets them return.
    * What ranks reported with :func:`report_progress` survives a failure: :class:`RankFailure` carries it.
"""

import ctypes
import io
import multiprocessing as mp
import os
import queue
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron.bridge.utils.process_groups import EPGroups, set_alive_listener


@dataclass
class RankOutcome:
    """What one rank returned, or the error it raised (formatted traceback)."""

    rank: int
    result: Any = None
    error: str | None = None


class RankFailure(RuntimeError):
    """One or more ranks raised, died, or made no progress for too long.

    Attributes:
        outcomes: Every rank's outcome, by rank.
        progress: Per rank, the payloads it reported with :func:`report_progress` before the failure.
        first: The ranks in the order their errors should be read: a rank that died first (its death is the cause
            the others' errors follow from), then by rank.
    """

    def __init__(
        self,
        outcomes: list[RankOutcome],
        message: str = "",
        progress: dict[int, list] | None = None,
        first: list[int] | None = None,
    ):
        self.outcomes = outcomes
        self.progress = progress or {}
        self.first = list(first or []) + [o.rank for o in outcomes if o.rank not in (first or [])]
        details = "\n".join(f"--- rank {r} ---\n{outcomes[r].error}" for r in self.first if outcomes[r].error)
        super().__init__(f"{message}\n{details}".strip())


_PROGRESS: tuple[Any, int] | None = None  # (queue, rank) inside a rank started by run_local_ranks


def report_progress(payload: Any = None) -> None:
    """Tells the parent this rank made progress, with a payload it keeps even if the run fails later.

    A no-op outside a rank started by :func:`run_local_ranks` (e.g. under torchrun).
    """
    if _PROGRESS is not None:
        results, rank = _PROGRESS
        results.put(("progress", rank, _dumps(payload)))


_HEARTBEAT_S = 0.5
_STARTED = "its start (process group up)"
_INTERRUPT_GRACE_S = 0.3
_last_heartbeat = 0.0


def heartbeat(what: str, *args) -> None:
    """Tells the parent this rank is alive, having just finished ``what % args`` (a collective, a compute node;
    formatted only when sent): at most every half second, so a long step of many short operations is never taken
    for a stall. A no-op outside a rank started by :func:`run_local_ranks`."""
    global _last_heartbeat
    if _PROGRESS is None:
        return
    now = time.monotonic()
    if now - _last_heartbeat >= _HEARTBEAT_S:
        _last_heartbeat = now
        results, rank = _PROGRESS
        results.put(("alive", rank, what % args if args else what))


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
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what an interrupt stops
    # The parent stops a rank with SIGTERM: it must end the rank at once. A handler inherited through fork would
    # raise wherever the rank is; inside a __del__ Python only prints that and the rank lives on until SIGKILL.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _PROGRESS = (results, rank)
    set_alive_listener(heartbeat)
    try:
        if rank_setup is not None:
            rank_setup(rank)
        torch.set_num_threads(threads)
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
        )
        results.put(("alive", rank, _STARTED))
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
    finish_after_interrupt: Callable[[], bool] | None = None,
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
        finish_after_interrupt: Asked when the parent is interrupted (SIGINT, or a signal turned into
            KeyboardInterrupt): True lets the ranks return (they have finished their work) instead of stopping them.
    """
    stall_timeout_s = stall_timeout_s or default_stall_timeout(collective_timeout_s)
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    init_method = f"tcp://{master_addr}:{free_port()}"
    worker_args = (backend, init_method, collective_timeout_s, threads_per_rank, rank_setup, results, os.getpid())
    procs = [
        ctx.Process(target=_worker, args=(fn, rank, nprocs, args, *worker_args), daemon=True) for rank in range(nprocs)
    ]
    for proc in procs:
        proc.start()
    run = _Collector(procs, results, stall_timeout_s, collective_timeout_s, on_progress, _SignalsAtSafePoints())
    try:
        _collect_all(run, finish_after_interrupt, collective_timeout_s)
    finally:
        # A signal that came after the last read is not lost, unless the ranks are done and it asked them to finish.
        finished = len(run.outcomes) == nprocs and finish_after_interrupt is not None and finish_after_interrupt()
        run.signals.restore(redeliver=not finished)
        _stop(procs)
    ordered = run.outcomes_by_rank()
    if raise_on_error and any(o.error for o in ordered):
        failed = sum(1 for o in ordered if o.error)
        raise RankFailure(ordered, f"{failed} of {nprocs} ranks failed", run.progress, first=run.died)
    return ordered


def _collect_all(run: "_Collector", finish_after_interrupt, collective_timeout_s: float) -> None:
    """Every rank's outcome; an interrupt stops the ranks, unless ``finish_after_interrupt()`` says they only have
    to return (then they may)."""
    try:
        run.collect()
    except KeyboardInterrupt:
        if finish_after_interrupt is None:
            raise
        # What the ranks sent just before the interrupt may still be in the queue: read it (briefly) first.
        run.collect(deadline=time.monotonic() + _INTERRUPT_GRACE_S, until=finish_after_interrupt)
        if not finish_after_interrupt():
            raise
        run.collect(deadline=time.monotonic() + collective_timeout_s)  # every step is done: let them return


class _SignalsAtSafePoints:
    """Holds SIGINT and SIGTERM until the parent is between two queue reads, then hands them to the handlers that
    were set before. A handler that raises in the middle of ``Queue.get`` would lose the message being read (a
    rank's result, and the rank would then look dead)."""

    def __init__(self):
        self.pending: list[int] = []
        self.previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self.previous[signum] = signal.signal(signum, lambda signum, _frame: self.pending.append(signum))

    def deliver(self) -> None:
        while self.pending:
            signum = self.pending.pop(0)
            handler = self.previous[signum]
            if callable(handler):
                handler(signum, None)
            elif handler == signal.SIG_DFL:
                self.pending.insert(0, signum)
                self.restore(redeliver=True)

    def restore(self, redeliver: bool = False) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}
        pending, self.pending = self.pending, []
        for signum in pending if redeliver else []:
            signal.raise_signal(signum)


class _Collector:
    """The parent's side of a run: results, progress and heartbeats as they arrive, dead ranks, stalls."""

    def __init__(self, procs, results, stall_timeout_s: float, collective_timeout_s: float, on_progress, signals):
        self.procs, self.results, self.on_progress, self.signals = procs, results, on_progress, signals
        self.stall_timeout_s, self.collective_timeout_s = stall_timeout_s, collective_timeout_s
        self.outcomes: dict[int, RankOutcome] = {}
        self.progress: dict[int, list] = {rank: [] for rank in range(len(procs))}
        self.last_seen: dict[int, str] = {}
        self.started: set[int] = set()  # ranks whose process group is up: the stall clock waits for all
        self.died: list[int] = []
        self.last_news, self.stalled, self.give_up_at = time.monotonic(), None, None

    def collect(self, deadline: float | None = None, until: Callable[[], bool] | None = None) -> None:
        """Until every rank has an outcome, a rank failed and the others had their chance, a stall, ``deadline``,
        or ``until()`` says so."""
        nprocs = len(self.procs)
        while len(self.outcomes) < nprocs and not (until is not None and until()):
            self.signals.deliver()
            now = time.monotonic()
            if (self.give_up_at is not None and now >= self.give_up_at) or (deadline is not None and now >= deadline):
                return
            try:
                kind, rank, payload = self.results.get(timeout=0.2)
            except queue.Empty:
                self._see_the_dead()
                silent = time.monotonic() - self.last_news
                if deadline is None and len(self.started) == nprocs and silent > self.stall_timeout_s:
                    self.stalled = silent
                    return
                continue
            self.last_news = time.monotonic()
            if kind == "alive":
                self.last_seen[rank] = payload
                self.started.add(rank)
            elif kind == "progress":
                self.started.add(rank)
                self.progress[rank].append(_loads(payload))
                if self.on_progress is not None:
                    self.on_progress(rank, self.progress[rank][-1])
            elif kind == "result":
                self.started.add(rank)
                self.outcomes[rank] = RankOutcome(rank, _loads(payload))
            else:
                self.outcomes[rank] = RankOutcome(rank, None, payload)
                # Peers of a failed rank fail at their next collective, within one timeout: collect their reasons.
                self._give_up_by(time.monotonic() + self.collective_timeout_s + 5)
            self._see_the_dead()

    def _give_up_by(self, when: float) -> None:
        self.give_up_at = when if self.give_up_at is None else min(self.give_up_at, when)

    def _see_the_dead(self) -> None:
        """A rank whose process ended without an outcome (and with nothing of its left in the queue) died."""
        dead = [r for r, p in enumerate(self.procs) if r not in self.outcomes and not p.is_alive()]
        if not dead or not self.results.empty():
            return
        for rank in dead:
            self.outcomes[rank] = RankOutcome(rank, None, _death(rank, self.procs[rank].exitcode))
            self.died.append(rank)
        self._give_up_by(time.monotonic() + 1.0)  # the survivors' own errors (a peer gone) arrive within that

    def outcomes_by_rank(self) -> list[RankOutcome]:
        for rank in range(len(self.procs)):
            if rank not in self.outcomes:
                self.outcomes[rank] = RankOutcome(rank, None, f"rank {rank}: {self._why_stopped(rank)}")
        return [self.outcomes[rank] for rank in range(len(self.procs))]

    def _why_stopped(self, rank: int) -> str:
        if self.stalled is None:
            return "stopped when another rank failed" if (self.died or self.give_up_at) else "stopped"
        last = self.last_seen.get(rank)
        return (
            f"no rank reported progress for {self.stalled:.0f} s (stall timeout {self.stall_timeout_s:.0f} s); this "
            + (f"rank last finished {last}" if last else "rank finished no collective or node at all")
        )


def _death(rank: int, exitcode: int | None) -> str:
    """Why a rank's process ended without reporting: the signal that killed it, or its exit status."""
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name
        hint = " (out of memory?)" if -exitcode == signal.SIGKILL else ""
        return f"rank {rank} was killed by {name}{hint}"
    return f"rank {rank} died without reporting (exit code {exitcode})"


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


# Process groups the lab and the tests create themselves (under Megatron-Bridge, Megatron-Core's parallel_state does).


def single_process_groups() -> EPGroups:
    """Groups for a model with EP = 1 and no process group (all communication is the identity)."""
    return EPGroups(1, 0, None, None, None, None, timedelta(seconds=60))


def init_ep_groups(
    expert_model_parallel_size: int, timeout: timedelta = timedelta(minutes=5), pipeline_size: int = 1
) -> EPGroups:
    """Creates the EP, EP-metadata, expert-DP, DP and pipeline groups. Every rank must call this, in the same order.

    The world is split into ``pipeline_size`` stages of consecutive ranks (the outermost dimension, as in
    Megatron-Core), each stage into EP groups of consecutive ranks. A stage's ranks are data-parallel for its
    non-expert weights (``dp_group``; the world without a pipeline); expert weights are replicated across
    ``expert_dp_group`` (the stage's ranks with the same EP rank); ``pp_group`` joins the ranks at the same place in
    every stage (gloo: pipeline P2P is matched by tag).

    Raises:
        ValueError: When the world size is not a multiple of ``pipeline_size * expert_model_parallel_size``.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    ep, pp = expert_model_parallel_size, pipeline_size
    if ep < 1 or pp < 1 or world % (ep * pp):
        raise ValueError(
            f"pipeline_model_parallel_size={pp} x expert_model_parallel_size={ep} must divide the world size "
            f"{world}; launch a multiple of {ep * pp} ranks or change the sizes."
        )
    stage = world // pp
    mine = {}
    for start in range(0, world, ep):
        ranks = list(range(start, start + ep))
        bulk = dist.new_group(ranks, timeout=timeout)
        meta = dist.new_group(ranks, timeout=timeout, backend="gloo")
        if rank in ranks:
            mine["ep"], mine["meta"] = bulk, meta
    for first in range(0, world, stage):
        for ep_rank in range(ep):
            group = dist.new_group(list(range(first + ep_rank, first + stage, ep)), timeout=timeout)
            if rank // stage == first // stage and rank % ep == ep_rank:
                mine["expert_dp"] = group
    if pp == 1:
        return EPGroups(ep, rank % ep, mine["ep"], mine["meta"], mine["expert_dp"], dist.group.WORLD, timeout)
    for first in range(0, world, stage):
        group = dist.new_group(list(range(first, first + stage)), timeout=timeout)
        if rank // stage == first // stage:
            mine["dp"] = group
    for offset in range(stage):
        ranks = tuple(range(offset, world, stage))
        group = dist.new_group(list(ranks), timeout=timeout, backend="gloo")
        if rank % stage == offset:
            mine["pp"], mine["pp_ranks"] = group, ranks
    return EPGroups(
        ep, rank % ep, mine["ep"], mine["meta"], mine["expert_dp"], mine["dp"], timeout,
        pp_size=pp, pp_rank=rank // stage, pp_group=mine["pp"], pp_ranks=mine["pp_ranks"],
    )  # fmt: skip
