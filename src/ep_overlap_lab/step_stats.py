"""What a step's records add up to: comm time, exposed comm time (all-to-all time that no compute covers), compute
time and the overlap fraction, for the engine's step result, the planner and the harness (no torch)."""

from dataclasses import dataclass

Intervals = list[tuple[float, float]]


def union(intervals: Intervals) -> Intervals:
    """The same time as sorted, disjoint intervals (overlapping or touching ones merged)."""
    merged: Intervals = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(intervals: Intervals) -> float:
    """The summed length of ``intervals`` (of their union, when they are disjoint)."""
    return sum(end - start for start, end in intervals)


def _covered(a: Intervals, b: Intervals) -> float:
    """Length of the intersection of two sorted disjoint interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def uncovered(intervals: Intervals, cover: Intervals) -> float:
    """Length of the union of ``intervals`` outside the union of ``cover``: comm that no compute hid."""
    intervals_u = union(intervals)
    return length(intervals_u) - _covered(intervals_u, union(cover))


@dataclass
class StepStats:
    """Per-step totals, in seconds."""

    comm_s: float
    exposed_comm_s: float
    compute_s: float

    @property
    def overlap_fraction(self) -> float:
        return 0.0 if self.comm_s <= 0 else 1.0 - self.exposed_comm_s / self.comm_s


def step_intervals(recorder) -> tuple[Intervals, Intervals]:
    """(comm intervals, compute intervals) of a ``StepRecorder``, in seconds from the step start; after the step."""
    seconds = recorder.clock.seconds
    comm = [(seconds(r.launch), seconds(r.done)) for r in recorder.comm if r.done is not None]
    compute = [(seconds(r.start), seconds(r.end)) for r in recorder.compute if r.end is not None]
    return comm, compute


def step_stats(recorder) -> StepStats:
    """The totals of a ``StepRecorder``'s step."""
    comm, compute = step_intervals(recorder)
    return StepStats(length(union(comm)), uncovered(comm, compute), length(union(compute)))


def records_as_dict(recorder) -> dict:
    """A ``StepRecorder``'s records in seconds from the step start, as the planner and the harness's JSON read them."""
    seconds = recorder.clock.seconds
    return {
        "comm": [
            {"op": r.op, "layer": r.layer, "microbatch": r.microbatch, "phase": r.phase,
             "start_s": seconds(r.launch), "end_s": seconds(r.done), "bytes_sent": r.bytes_sent,
             "bytes_received": r.bytes_received}
            for r in recorder.comm if r.done is not None
        ],
        "compute": [
            {"node": r.node, "layer": r.layer, "microbatch": r.microbatch, "phase": r.phase,
             "start_s": seconds(r.start), "end_s": seconds(r.end)}
            for r in recorder.compute if r.end is not None
        ],
    }  # fmt: skip
