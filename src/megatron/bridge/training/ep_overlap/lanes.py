"""Compute and comm lanes behind one small interface.

``lane.compute(node, layer, microbatch)`` wraps a compute node; ``lane.all_to_all(...)`` launches an all-to-all
and returns a :class:`Pending` whose ``wait()`` hands the result to the consumer.

* CPU (gloo): compute runs on the host thread; an all-to-all is gloo async work, which progresses on gloo's
  own threads, so it overlaps whatever the host computes until ``wait()``.
* CUDA: compute runs on the current stream; all-to-alls run on one dedicated comm stream (optionally high
  priority). Each microbatch has one event chain: a compute node records the microbatch's event when it
  ends, its next all-to-all waits on that event, and the consumer's stream waits on the all-to-all's end
  event. Different microbatches share no event, so the host issue order is the schedule.

Both lanes record every node and all-to-all in the step's :class:`StepRecorder`, and every wait runs under
the process groups' timeout.
"""

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from megatron.bridge.training.ep_overlap.records import CommRecord, ComputeRecord, CudaClock, HostClock, StepRecorder
from megatron.bridge.utils.process_groups import EPGroups, exchanged_bytes, wait_work


class Pending:
    """A transfer in flight; ``wait()`` returns its output once (later calls return the same tensor).

    ``convert`` (optional) maps the arrived buffer to what the consumer gets (e.g. host to device).
    """

    def __init__(self, out: torch.Tensor, wait_fn=None, record: CommRecord | None = None, convert=None):
        self._out, self._wait_fn, self._record, self._convert = out, wait_fn, record, convert

    def wait(self) -> torch.Tensor:
        if self._wait_fn is not None:
            if self._record is not None:
                self._record.wait_start_host = time.perf_counter()
            self._wait_fn()
            if self._record is not None:
                self._record.wait_end_host = time.perf_counter()
            self._wait_fn = None
            if self._convert is not None:
                self._out = self._convert(self._out)
        return self._out


def done(tensor: torch.Tensor) -> Pending:
    """A Pending that needs no communication (dense layers, EP = 1)."""
    return Pending(tensor)


class _Lane:
    def __init__(self, groups: EPGroups, recorder: StepRecorder):
        self.groups = groups
        self.recorder = recorder

    @contextmanager
    def compute(self, node: str, layer: int, microbatch: int) -> Iterator[None]:
        """Records a compute node of ``microbatch`` around the enclosed work."""
        clock = self.recorder.clock
        record = ComputeRecord(node, layer, microbatch, self.recorder.phase, clock.mark(), time.perf_counter())
        yield
        record.end = clock.mark()
        record.end_host = time.perf_counter()
        self.recorder.compute.append(record)
        self._after_compute(microbatch)

    def _after_compute(self, microbatch: int) -> None:
        pass

    def record_comm(
        self, op: str, layer: int, microbatch: int, stream=None, exchanged: tuple[int, int] = (0, 0)
    ) -> CommRecord:
        """Records that an all-to-all is being launched now (on ``stream``, for the CUDA clock).

        ``exchanged`` is (bytes sent to other ranks, bytes received from them).
        """
        record = CommRecord(
            op, layer, microbatch, self.recorder.phase, self.recorder.clock.mark(stream), time.perf_counter()
        )
        record.bytes_sent, record.bytes_received = exchanged
        self.recorder.comm.append(record)
        return record


class CpuLane(_Lane):
    """gloo async all-to-all; the host computes while gloo's threads move the data."""

    def all_to_all(
        self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], *, op: str, layer: int, microbatch: int
    ) -> Pending:
        clock = self.recorder.clock
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        exchanged = exchanged_bytes(x, out_splits, in_splits, self.groups.ep_rank)
        record = self.record_comm(op, layer, microbatch, exchanged=exchanged)
        work = dist.all_to_all_single(
            out, x.contiguous(), out_splits, in_splits, group=self.groups.ep_group, async_op=True
        )

        def finished(_future) -> None:  # runs on a gloo thread when the data has arrived
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
    """All-to-all on a dedicated comm stream, chained to compute by one event per microbatch."""

    def __init__(self, groups: EPGroups, recorder: StepRecorder, high_priority: bool = False):
        super().__init__(groups, recorder)
        self.comm_stream = torch.cuda.Stream(priority=-1 if high_priority else 0)
        self._events: dict[int, torch.cuda.Event] = {}

    def _after_compute(self, microbatch: int) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        self._events[microbatch] = event

    def all_to_all(
        self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], *, op: str, layer: int, microbatch: int
    ) -> Pending:
        compute_stream = torch.cuda.current_stream()
        ready = self._events.get(microbatch)
        if ready is not None:
            self.comm_stream.wait_event(ready)
        else:
            self.comm_stream.wait_stream(compute_stream)
        with torch.cuda.stream(self.comm_stream):
            exchanged = exchanged_bytes(x, out_splits, in_splits, self.groups.ep_rank)
            record = self.record_comm(op, layer, microbatch, self.comm_stream, exchanged)
            out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
            dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=self.groups.ep_group)
            record.done = self.recorder.clock.mark(self.comm_stream)
        # The caching allocator must not reuse these blocks while the other stream still uses them.
        x.record_stream(self.comm_stream)
        out.record_stream(compute_stream)
        end = record.done
        return Pending(out, lambda: torch.cuda.current_stream().wait_event(end), record)


def make_lane(groups: EPGroups, device: torch.device, *, high_priority: bool = False) -> _Lane:
    """The lane for ``device``, with a fresh recorder (one per step)."""
    if device.type == "cuda":
        return CudaLane(groups, StepRecorder(clock=CudaClock()), high_priority)
    return CpuLane(groups, StepRecorder(clock=HostClock()))
