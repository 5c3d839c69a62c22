"""Prices DualPipeV beside 1F1B and interleaved 1F1B for one model and cluster, and says which schedule to pick.

Contract:
    * Each schedule's per-rank op list is the one that runs: ``pipeline_schedule`` (1F1B: V = 1; interleaved:
      ``virtual_size`` chunks per rank) and ``dualpipev_schedule``. :func:`simulate_schedules` times every rank's list
      against the others' (a step starts when its rank is free and its receives have arrived, P2P free).
    * A chunk costs its layers' sum of the per-layer costs: F, B (input and weight gradients), W (the weight
      gradients DualPipeV defers; its backward then costs B - W) and F&B (a forward and a backward of different
      microbatches, overlapped: the paired layer step). With the overlap off no step is paired.
    * Reported per schedule: the step time, the bubble (the worst rank's idle time in the step), the most layer
      activations a rank holds at once (a forward begun, its backward, or W, not done), and the P2P bytes a rank
      sends per step (one activation or gradient of ``boundary_bytes`` per transfer).
    * Not priced: the embedding, head and loss; P2P time; uneven stages (the layers must split evenly).
"""

from dataclasses import dataclass

from ep_overlap_lab.program.dualpipev import Costs, simulate_schedules
from ep_overlap_lab.program.pipeline import pipeline_schedule
from megatron.bridge.training.ep_overlap.program.dualpipev import dualpipev_problem, dualpipev_schedule

SCHEDULES = ("1f1b", "interleaved", "dualpipev")


@dataclass(frozen=True)
class LayerCosts:
    """One layer, one microbatch: seconds of forward, backward, deferred weight gradient and paired F&B; and the
    bytes of an activation (or its gradient) at a stage boundary."""

    forward_s: float
    backward_s: float
    weight_s: float
    paired_s: float
    boundary_bytes: int = 0


@dataclass(frozen=True)
class SchedulePrice:
    schedule: str
    step_s: float
    bubble_s: float
    held_layers: int  # the most layer activations a rank holds at once
    p2p_bytes: int  # the most bytes a rank sends per step
    problem: str | None = None  # why the schedule cannot run this (then the numbers are 0)


def price(
    schedule: str, layers: int, pipeline_size: int, num_microbatches: int, costs: LayerCosts, *, virtual_size: int = 2,
    overlap: bool = True,
) -> SchedulePrice:  # fmt: skip
    """One schedule's price (see the module docstring); a problem (with its fix) where it cannot run."""
    P, N = pipeline_size, num_microbatches
    chunks = {"1f1b": 1, "interleaved": virtual_size, "dualpipev": 2}[schedule]
    problem = dualpipev_problem(P, N) if schedule == "dualpipev" else None
    if layers % (P * chunks):
        problem = f"{layers} layers do not split into {P * chunks} equal stages; fix: choose another schedule or PP"
    if problem is not None:
        return SchedulePrice(schedule, 0.0, 0.0, 0, 0, problem)
    per_chunk = layers // (P * chunks)
    chunk_costs = Costs(
        forward=costs.forward_s * per_chunk,
        backward=costs.backward_s * per_chunk,
        weight=costs.weight_s * per_chunk,
        paired=costs.paired_s * per_chunk,
    )
    if schedule == "dualpipev":
        lists = [dualpipev_schedule(P, N, r, overlap=overlap) for r in range(P)]
    else:
        lists = [pipeline_schedule(P, chunks, N, r, overlap=overlap) for r in range(P)]
    timeline = simulate_schedules(lists, chunk_costs)
    sends = max(sum(len(step.send) for step in steps) for steps in lists)
    return SchedulePrice(
        schedule,
        timeline.span,
        max(timeline.bubbles),
        max(timeline.in_flight) * per_chunk,
        sends * costs.boundary_bytes,
    )


def pick(prices: list[SchedulePrice]) -> SchedulePrice:
    """The schedule to pick: the shortest step among those that run, then the fewest activations held."""
    runnable = [p for p in prices if p.problem is None]
    if not runnable:
        raise ValueError("no schedule runs: " + "; ".join(f"{p.schedule}: {p.problem}" for p in prices))
    return min(runnable, key=lambda p: (p.step_s, p.held_layers))


def format_prices(prices: list[SchedulePrice]) -> str:
    """A table: one row per schedule, the pick marked."""
    chosen = pick(prices)
    rows = [f"{'schedule':12} {'step_s':>10} {'bubble_s':>10} {'held layers':>12} {'P2P bytes':>12}"]
    for p in prices:
        if p.problem is not None:
            rows.append(f"{p.schedule:12} cannot run: {p.problem}")
            continue
        mark = "  <- pick" if p is chosen else ""
        rows.append(f"{p.schedule:12} {p.step_s:10.4g} {p.bubble_s:10.4g} {p.held_layers:12d} {p.p2p_bytes:12d}{mark}")
    return "\n".join(rows)
