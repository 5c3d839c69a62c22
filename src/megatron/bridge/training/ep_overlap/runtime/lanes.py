"""Compute and comm lanes behind one interface. CPU (gloo): compute on the host, all-to-alls as gloo async work. CUDA:
all-to-alls on Megatron-Core's comm stream, chained to compute by events per (global layer, microbatch), so a launch
never waits for another virtual stage's compute; events are reused every step. Timing and NVTX only when profiling."""

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from megatron.bridge.training.ep_overlap.program.interpreter import IssueOrder
from megatron.bridge.training.ep_overlap.program.pipeline import BACKWARD, FORWARD
from megatron.bridge.training.ep_overlap.runtime.records import (
    CommRecord,
    ComputeRecord,
    CudaClock,
    HostClock,
    StepRecorder,
    profiling,
)
from megatron.bridge.utils.process_groups import EPGroups, exchanged_bytes, tell_alive, wait_work

Splits = Callable[[], tuple[list[int], list[int]]]  # -> (out_splits, in_splits) of an all-to-all


class Pending:
    """A transfer in flight; ``wait()`` returns its output, later calls the same."""

    def __init__(self, out: torch.Tensor, wait_fn=None, record: CommRecord | None = None):
        self._out, self._wait_fn, self._record = out, wait_fn, record

    def wait(self) -> torch.Tensor:
        if self._wait_fn is not None:
            if self._record is not None:
                self._record.wait_start_host = time.perf_counter()
            self._wait_fn()
            if self._record is not None:
                self._record.wait_end_host = time.perf_counter()
            self._wait_fn = None
        return self._out


def done(tensor: torch.Tensor) -> Pending:
    """A Pending that needs no communication (dense layers, EP = 1)."""
    return Pending(tensor)


def range_name(kind: str, name: str, layer: int, microbatch: int, role: str | None = None) -> str:
    """A node's NVTX range, ``ep_overlap/<kind>/<F|B>.<node>[/L<layer>]/mb<microbatch>`` (no ``L`` for layer -1)."""
    role = role or (BACKWARD if name.endswith(("_bwd", "wgrad")) else FORWARD)
    base = name[: -len("_bwd")] if name.endswith("_bwd") else name
    where = f"/L{layer}" if layer >= 0 else ""
    return f"ep_overlap/{kind}/{role}.{base}{where}/mb{microbatch}"


class _Lane:
    issue = IssueOrder.HOST
    launches_off_host = False
    # An all-to-all's input may be freed once launched (the allocator keeps its block until the comm stream ran it)
    frees_at_launch = False
    # The step's count of saved tensors (engine/saved.py), if kept: a buffer is freed early only if none shares it
    saved = None
    nvtx = None

    def __init__(self, groups: EPGroups, recorder: StepRecorder):
        self.groups = groups
        self.recorder = recorder

    def new_step(self) -> None:
        self.recorder = StepRecorder(clock=HostClock())

    @contextmanager
    def ranged(self, kind: str, name: str, layer: int, microbatch: int, role: str | None = None) -> Iterator[None]:
        if self.nvtx is None or not profiling():
            yield
            return
        self.nvtx.range_push(range_name(kind, name, layer, microbatch, role))
        try:
            yield
        finally:
            self.nvtx.range_pop()

    @contextmanager
    def compute(self, node: str, layer: int, microbatch: int) -> Iterator[None]:
        """Records the enclosed work as a compute node."""
        clock = self.recorder.clock
        record = ComputeRecord(node, layer, microbatch, self.recorder.phase, clock.mark(), time.perf_counter())
        with self.ranged("compute", node, layer, microbatch):
            yield
        record.end = clock.mark()
        record.end_host = time.perf_counter()
        self.recorder.compute.append(record)
        self._after_compute(node, layer, microbatch)
        tell_alive("%s (layer %d, microbatch %d)", node, layer, microbatch)

    def _after_compute(self, node: str, layer: int, microbatch: int) -> None:
        pass

    def launch(self, splits: Splits, tensors: list[torch.Tensor], *, op: str, layer: int, microbatch: int):
        """All-to-alls of ``tensors`` with the split sizes ``splits()`` returns (it may wait for them)."""
        out_splits, in_splits = splits()
        return [self.all_to_all(t, out_splits, in_splits, op=op, layer=layer, microbatch=microbatch) for t in tensors]

    def run_comm(self, fn: Callable[[], object], *, op: str, layer: int, microbatch: int) -> Pending:
        """Runs ``fn`` (a unit's own communication) now, on the host."""
        record = self.record_comm(op, layer, microbatch)
        out = fn()
        record.done = self.recorder.clock.mark()
        return Pending(out)

    @contextmanager
    def reading(self, layer: int, microbatch: int) -> Iterator[None]:
        """Where a host read of the key's split sizes is issued (on CUDA: the comm stream, after the key's compute)."""
        yield

    def used_on_comm(self, tensors) -> None:
        """``tensors`` (made by compute) are read by the next ``run_comm``: on CUDA, kept from reuse until it ran."""

    def close(self, *, failed: bool = False) -> None:
        """Ends the step's lane (shuts its helper thread down, if any); ``failed``: the step raised, wait for none."""

    def record_comm(
        self, op: str, layer: int, microbatch: int, stream=None, exchanged=(0, 0), asked: tuple | None = None
    ) -> CommRecord:
        """Records an all-to-all launched now; ``asked``: (phase, host time) the host asked for it, when earlier."""
        phase, issued_host = (self.recorder.phase, time.perf_counter()) if asked is None else asked
        record = CommRecord(op, layer, microbatch, phase, self.recorder.clock.mark(stream), issued_host)
        record.bytes_sent, record.bytes_received = exchanged
        self.recorder.comm.append(record)
        return record


class CpuLane(_Lane):
    """gloo async all-to-all; the host computes meanwhile."""

    def all_to_all(
        self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], *, op: str, layer: int, microbatch: int
    ) -> Pending:
        return self._start(x, out_splits, in_splits, op, layer, microbatch)

    def _start(
        self,
        x: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        op: str,
        layer: int,
        microbatch: int,
        asked: tuple[str, float] | None = None,
    ) -> Pending:
        clock = self.recorder.clock
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        exchanged = exchanged_bytes(x, out_splits, in_splits, self.groups.ep_rank)
        record = self.record_comm(op, layer, microbatch, exchanged=exchanged, asked=asked)
        work = dist.all_to_all_single(
            out, x.contiguous(), out_splits, in_splits, group=self.groups.ep_group, async_op=True
        )

        def finished(_future) -> None:
            if record.done is None:
                record.done = clock.mark()

        work.get_future().then(finished)
        name = f"layer{layer} {op} (microbatch {microbatch})"

        def wait() -> None:
            wait_work(work, op=name, timeout=self.groups.timeout)
            if record.done is None:  # the completion callback may not have run yet
                record.done = clock.mark()

        return Pending(out, wait, record)


class CudaLane(_Lane):
    """All-to-all on the comm stream after its (layer, microbatch)'s ready event; waited for by that key's done
    event. A wait sees an event's latest record, so events are reused and a steady step creates none."""

    issue = IssueOrder.DEVICE
    frees_at_launch = True  # all_to_all records its input on the comm stream
    _CHUNK_ENDS = frozenset({"embedding", "embedding_bwd", "head", "head_bwd"})  # no all-to-all follows them

    def __init__(self, groups: EPGroups, recorder: StepRecorder, comm_stream=None, nvtx=None):
        super().__init__(groups, recorder)
        self.nvtx = nvtx if nvtx is not None else torch.cuda.nvtx
        self.comm_stream = comm_stream if comm_stream is not None else torch.cuda.Stream()
        self._ready: dict[tuple[int, int], torch.cuda.Event] = {}
        self._done: dict[tuple[int, int], torch.cuda.Event] = {}
        self._recorded: set[tuple[int, int]] = set()  # ready events recorded in this step

    def new_step(self) -> None:
        self.recorder = StepRecorder(clock=CudaClock() if profiling() else HostClock())
        self._recorded.clear()

    @staticmethod
    def _event(events: dict, key: tuple[int, int]) -> torch.cuda.Event:
        event = events.get(key)
        if event is None:
            event = events[key] = torch.cuda.Event()
        return event

    def _after_compute(self, node: str, layer: int, microbatch: int) -> None:
        if node not in self._CHUNK_ENDS:
            self._event(self._ready, (layer, microbatch)).record(torch.cuda.current_stream())
            self._recorded.add((layer, microbatch))

    def _comm_waits_for(self, layer: int, microbatch: int) -> torch.cuda.Stream:
        """The comm stream waits for the key's last compute (else all compute); returns the compute stream."""
        compute_stream = torch.cuda.current_stream()
        if (layer, microbatch) in self._recorded:
            self.comm_stream.wait_event(self._ready[(layer, microbatch)])
        else:
            self.comm_stream.wait_stream(compute_stream)
        return compute_stream

    def _finished(self, layer: int, microbatch: int) -> Callable[[], None]:
        done_event = self._event(self._done, (layer, microbatch))
        done_event.record(self.comm_stream)
        return lambda: torch.cuda.current_stream().wait_event(done_event)

    def all_to_all(
        self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], *, op: str, layer: int, microbatch: int
    ) -> Pending:
        compute_stream = self._comm_waits_for(layer, microbatch)
        with torch.cuda.stream(self.comm_stream), self.ranged("comm", op, layer, microbatch):
            exchanged = exchanged_bytes(x, out_splits, in_splits, self.groups.ep_rank)
            record = self.record_comm(op, layer, microbatch, self.comm_stream, exchanged)
            out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
            dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=self.groups.ep_group)
            record.done = self.recorder.clock.mark(self.comm_stream)
        # The caching allocator must not reuse these blocks while the other stream still uses them.
        x.record_stream(self.comm_stream)
        out.record_stream(compute_stream)
        return Pending(out, self._finished(layer, microbatch), record)

    def used_on_comm(self, tensors) -> None:
        for tensor in tensors:  # as Megatron-Core's ScheduleNode records the gradients its backward is given
            if tensor is not None:
                tensor.record_stream(self.comm_stream)

    @contextmanager
    def reading(self, layer: int, microbatch: int) -> Iterator[None]:
        # As Megatron-Core's dispatch node: its copy then waits for no compute queued after the key's own
        self._comm_waits_for(layer, microbatch)
        with torch.cuda.stream(self.comm_stream):
            yield

    def run_comm(self, fn: Callable[[], object], *, op: str, layer: int, microbatch: int) -> Pending:
        """``fn`` on the comm stream after the microbatch's compute; its autograd backward stays on that stream."""
        compute_stream = self._comm_waits_for(layer, microbatch)
        with torch.cuda.stream(self.comm_stream), self.ranged("comm", op, layer, microbatch):
            record = self.record_comm(op, layer, microbatch, self.comm_stream)
            out = fn()
            record.done = self.recorder.clock.mark(self.comm_stream)
        for tensor in out if isinstance(out, list | tuple) else [out]:
            if tensor is not None:
                tensor.record_stream(compute_stream)
        return Pending(out, self._finished(layer, microbatch), record)


def make_lane(groups: EPGroups, device: torch.device, *, high_priority: bool = False, timed: bool = True) -> _Lane:
    """The lane for ``device``, with a fresh recorder (``timed``: CUDA timing events, until :meth:`new_step`)."""
    if device.type == "cuda":
        from megatron.core.pipeline_parallel.utils import get_comm_stream, set_streams

        set_streams(high_priority=high_priority)  # Megatron-Core's comm stream, one per process
        return CudaLane(groups, StepRecorder(clock=CudaClock() if timed else HostClock()), get_comm_stream())
    return CpuLane(groups, StepRecorder(clock=HostClock()))
