"""What the engine records per step (each all-to-all's launch, finish and wait; each compute node's run), and the
comm time, exposed comm time (all-to-all time no compute covers) and overlap fraction it reports. Times are seconds
from the step start: host clocks on CPU (a gloo completion callback marks a finish), CUDA events on CUDA."""

import time
from dataclasses import dataclass, field

import torch

from megatron.bridge.training.ep_overlap.intervals import length, uncovered, union
from megatron.bridge.training.ep_overlap.program.pipeline import Phase


class HostClock:
    """Marks are host times."""

    def __init__(self):
        self.t0 = time.perf_counter()

    def mark(self, stream=None) -> float:
        return time.perf_counter()

    def seconds(self, mark: float) -> float:
        return mark - self.t0


class CudaClock:
    """Marks are CUDA events recorded on a stream; resolved after the step synchronizes."""

    def __init__(self):
        self.t0 = torch.cuda.Event(enable_timing=True)
        self.t0.record()

    def mark(self, stream=None) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def seconds(self, mark: torch.cuda.Event) -> float:
        return self.t0.elapsed_time(mark) / 1000.0


@dataclass
class CommRecord:
    """One all-to-all: ``launch``/``done`` are clock marks of when it went out and arrived, ``*_host`` host readings of
    when the host asked for it (an off-host launch may go later) and waited, ``bytes_*`` what crossed the link."""

    op: str
    layer: int
    microbatch: int
    phase: str
    launch: object
    launch_host: float
    done: object = None
    wait_start_host: float | None = None
    wait_end_host: float | None = None
    bytes_sent: int = 0
    bytes_received: int = 0


@dataclass
class ComputeRecord:
    """One compute node; ``start``/``end`` are clock marks, the ``*_host`` fields host readings."""

    node: str
    layer: int
    microbatch: int
    phase: str
    start: object
    start_host: float
    end: object = None
    end_host: float | None = None


@dataclass
class StepStats:
    """Per-step totals, in seconds."""

    comm_s: float
    exposed_comm_s: float
    compute_s: float

    @property
    def overlap_fraction(self) -> float:
        return 0.0 if self.comm_s <= 0 else 1.0 - self.exposed_comm_s / self.comm_s


@dataclass
class StepRecorder:
    """Collects the records of one step. ``phase`` is set by the schedule as it goes."""

    clock: object = field(default_factory=HostClock)
    phase: str = Phase.WARMUP
    comm: list[CommRecord] = field(default_factory=list)
    compute: list[ComputeRecord] = field(default_factory=list)

    def intervals(self) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
        """(comm intervals, compute intervals) in seconds from the step start; call after the step finished."""
        seconds = self.clock.seconds
        comm = [(seconds(r.launch), seconds(r.done)) for r in self.comm if r.done is not None]
        compute = [(seconds(r.start), seconds(r.end)) for r in self.compute if r.end is not None]
        return comm, compute

    def stats(self) -> StepStats:
        comm, compute = self.intervals()
        return StepStats(length(union(comm)), uncovered(comm, compute), length(union(compute)))

    def as_dict(self) -> dict:
        """The records in seconds from the step start, as the planner and the harness's JSON read them."""
        seconds = self.clock.seconds
        return {
            "comm": [
                {"op": r.op, "layer": r.layer, "microbatch": r.microbatch, "phase": r.phase,
                 "start_s": seconds(r.launch), "end_s": seconds(r.done), "bytes_sent": r.bytes_sent,
                 "bytes_received": r.bytes_received}
                for r in self.comm if r.done is not None
            ],
            "compute": [
                {"node": r.node, "layer": r.layer, "microbatch": r.microbatch, "phase": r.phase,
                 "start_s": seconds(r.start), "end_s": seconds(r.end)}
                for r in self.compute if r.end is not None
            ],
        }  # fmt: skip
