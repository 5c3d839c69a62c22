"""DualPipeV's timed simulation: every rank's op list (the payload's ``program/dualpipev.py``) run against the
others' with DualPipe's costs (F, B, W, F&B); it raises on a cycle of receives, an unmatched or repeated transfer, a
backward before its forward or a W before its backward, and gives each rank's bubble and activations held."""

from dataclasses import dataclass

from megatron.bridge.training.ep_overlap.program.dualpipev import dualpipev_schedule
from megatron.bridge.training.ep_overlap.program.pipeline import PipelineStep


@dataclass(frozen=True)
class Costs:
    """Times of one stage's work (DualPipe's notation): ``forward`` F, ``backward`` B (input and weight gradients),
    ``weight`` W (a deferred weight gradient; its backward then takes B - W), ``paired`` F&B (a forward and a
    backward of different stages, overlapped)."""

    forward: float = 1.0
    backward: float = 2.0
    weight: float = 1.0
    paired: float = 2.5


@dataclass(frozen=True)
class Timeline:
    """A simulated step: per rank, each step's (start, end); the step's span; per rank, its idle time in the span
    (``bubbles``) and the most stage activations it held at once (from a forward to its last backward or W)."""

    steps: list[list[PipelineStep]]
    times: list[list[tuple[float, float]]]
    span: float
    bubbles: list[float]
    in_flight: list[int]


def published_bubble(pipeline_size: int, costs: Costs) -> float:
    """DualPipe's README: (PP/2 - 1)(F&B + B - 3W), PP the stages; DualPipeV runs PP = 2P stages on P ranks."""
    return (pipeline_size - 1) * (costs.paired + costs.backward - 3 * costs.weight)


def _duration(step: PipelineStep, deferred: set[tuple[int, int]], costs: Costs) -> float:
    if step.weight is not None:
        return costs.weight
    if step.paired:
        return costs.paired
    if step.forward is not None:
        return costs.forward
    return costs.backward - (costs.weight if step.backward in deferred else 0)


def _check_unit(r: int, k: int, step: PipelineStep, forwarded: set, backwarded: set, done: set) -> None:
    if step.forward is not None:
        forwarded.add(step.forward)
    if step.backward is not None:
        if step.backward not in forwarded:
            raise RuntimeError(f"rank {r} step {k}: backward of {step.backward} before its forward")
        backwarded.add(step.backward)
    if step.weight is not None:
        if step.weight not in backwarded:
            raise RuntimeError(f"rank {r} step {k}: W of {step.weight} before its backward")
        done.add(step.weight)


def simulate_dualpipev(
    pipeline_size: int, num_microbatches: int, *, overlap: bool = True, costs: Costs = Costs()
) -> Timeline:
    """The timeline of every rank's :func:`dualpipev_schedule`, checked by :func:`simulate_schedules`."""
    P = pipeline_size
    return simulate_schedules([dualpipev_schedule(P, num_microbatches, r, overlap=overlap) for r in range(P)], costs)


def simulate_schedules(schedules: list[list[PipelineStep]], costs: Costs = Costs()) -> Timeline:
    """Runs every rank's list against the others' (a step starts when its rank is free and each transfer it receives
    has arrived; transfers take no time) and returns the timeline; a RuntimeError on deadlock (naming each blocked
    rank and transfer), an unmatched or repeated transfer, or work out of order."""
    P = len(schedules)
    _check_transfers(schedules)
    deferred = [{s.weight for s in steps if s.weight is not None} for steps in schedules]
    times: list[list[tuple[float, float]]] = [[] for _ in range(P)]
    arrival: dict[tuple[str, int, int], float] = {}
    units = [(set(), set(), set()) for _ in range(P)]
    live, held = [0] * P, [0] * P
    while True:
        progressed = False
        for r, steps in enumerate(schedules):
            while len(times[r]) < len(steps):
                k, step = len(times[r]), steps[len(times[r])]
                if any((t.kind, t.microbatch, t.chunk) not in arrival for t in step.recv):
                    break
                _check_unit(r, k, step, *units[r])
                ready = [arrival[t.kind, t.microbatch, t.chunk] for t in step.recv]
                start = max([times[r][-1][1] if times[r] else 0.0, *ready])
                end = start + _duration(step, deferred[r], costs)
                times[r].append((start, end))
                arrival.update(((t.kind, t.microbatch, t.chunk), end) for t in step.send)
                live[r] += step.forward is not None
                held[r] = max(held[r], live[r])
                live[r] -= step.weight is not None or (step.backward is not None and step.backward not in deferred[r])
                progressed = True
        if all(len(t) == len(s) for t, s in zip(times, schedules)):
            break
        if not progressed:
            raise RuntimeError("the DualPipeV schedule deadlocks: " + "; ".join(_blocked(schedules, times, arrival)))
    span = max(t[-1][1] for t in times)
    bubbles = [span - sum(end - start for start, end in t) for t in times]
    return Timeline(schedules, times, span, bubbles, held)


def _check_transfers(schedules: list[list[PipelineStep]]) -> None:
    """Every transfer sent once, received once, by the rank it names, from the rank that names it."""
    sent, received = {}, {}
    for r, steps in enumerate(schedules):
        for step in steps:
            for ends, transfers in ((sent, step.send), (received, step.recv)):
                for t in transfers:
                    key = (t.kind, t.microbatch, t.chunk)
                    if key in ends:
                        raise RuntimeError(f"rank {r}: transfer {key} appears twice")
                    ends[key] = (r, t.peer)
    if sent.keys() != received.keys():
        raise RuntimeError(f"unmatched transfers: {sorted(sent.keys() ^ received.keys())}")
    for key, (sender, to) in sent.items():
        if received[key] != (to, sender):
            raise RuntimeError(f"transfer {key}: sent by {sender} to {to}, received as {received[key]}")


def _blocked(schedules, times, arrival) -> list[str]:
    return [
        f"rank {r} at step {len(times[r])} waits for "
        + ", ".join(
            f"{t.kind}(microbatch {t.microbatch}, stage {t.chunk}) from rank {t.peer}"
            for t in steps[len(times[r])].recv
            if (t.kind, t.microbatch, t.chunk) not in arrival
        )
        for r, steps in enumerate(schedules)
        if len(times[r]) < len(steps)
    ]


def draw_timeline(timeline: Timeline, width: int = 4) -> str:
    """Each rank's steps on one time axis, ``width`` characters a time unit: ``F``/``B``/``W`` for stage r's work,
    ``f``/``b``/``w`` for stage 2P-1-r's, then the microbatch; ``F&B`` steps as ``F3b0``; ``.`` idle."""
    lines = []
    for r, (steps, times) in enumerate(zip(timeline.steps, timeline.times)):
        row = ["."] * round(timeline.span * width)
        for step, (start, end) in zip(steps, times):
            label = "".join(
                ("FBW"[i] if unit[1] == 0 else "fbw"[i]) + str(unit[0])
                for i, unit in enumerate((step.forward, step.backward, step.weight))
                if unit is not None
            )
            cells = round((end - start) * width)
            row[round(start * width) : round(end * width)] = list(f"|{label}".ljust(cells)[:cells])
        lines.append(f"rank {r}  {''.join(row)}")
    return "\n".join(lines)
