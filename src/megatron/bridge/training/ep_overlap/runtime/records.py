"""What a step records: each all-to-all's launch, finish and wait, each compute node's run, as clock marks (host times,
or timing CUDA events when the step is profiled on CUDA), for profiling and tests."""

import time
from dataclasses import dataclass, field

import torch
from megatron.core import utils as mcore_utils

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
    """Marks are timing CUDA events recorded on a stream; resolved after the step synchronizes. Only for a profiled
    step: each mark is an event created and recorded."""

    def __init__(self):
        self.t0 = torch.cuda.Event(enable_timing=True)
        self.t0.record()

    def mark(self, stream=None) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def seconds(self, mark: torch.cuda.Event) -> float:
        return self.t0.elapsed_time(mark) / 1000.0


def profiling() -> bool:
    """Whether the user profiles: Megatron-Core's NVTX switch (``configure_nvtx_profiling``; Megatron-LM turns it on
    for ``--profile-step-start``..end with ``--nvtx-ranges``). Timing events and NVTX ranges only then."""
    return bool(getattr(mcore_utils, "_nvtx_enabled", False))


@dataclass
class CommRecord:
    """One all-to-all: clock marks ``launch``/``done``; ``launch_host`` is when the host asked (it may go later)."""

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
    """One compute node's run."""

    node: str
    layer: int
    microbatch: int
    phase: str
    start: object
    start_host: float
    end: object = None
    end_host: float | None = None


@dataclass
class StepRecorder:
    """Collects the records of one step. ``phase`` is set by the schedule as it goes."""

    clock: object = field(default_factory=HostClock)
    phase: str = Phase.WARMUP
    comm: list[CommRecord] = field(default_factory=list)
    compute: list[ComputeRecord] = field(default_factory=list)
