"""DualPipeV's per-rank op list, as data (no torch), and a timed simulation that checks it.

Layout: P pipeline ranks run 2P stages in a V. Rank r holds stage r (virtual stage 0: the activation flows r -> r+1)
and stage 2P-1-r (virtual stage 1: it flows back r -> r-1), so rank 0 holds the embedding (stage 0) and the head and
loss (stage 2P-1), and the last rank hands stage P-1's output to stage P locally. Each stage runs its forwards, and
its backwards, in microbatch order. A ``PipelineStep`` names (microbatch, virtual stage) as ``forward``/``backward``,
a deferred weight gradient (W) as ``weight``; its ``Transfer``s name the global stage (the lab's tag scheme over 2P
chunks). A backward whose W a later step runs computes only its input gradient; W steps run in the order their
backwards were queued (DualPipe's ``WeightGradStore``). The phases are DualPipeV's, for N >= 2P microbatches:

1. ``nF0``     warm-up forwards of stage r, 2 (P - r - 1) of them
2. ``nF0F1``   r + 1 pairs of forwards, stage r then stage 2P-1-r
3. ``nB1W1F1`` P - r - 1 times: backward of stage 2P-1-r (W deferred), one W, a forward of stage 2P-1-r
4. ``nF0B1F1B0`` N - 2P + r + 1 times: F&B of (F stage r, B stage 2P-1-r), then F&B of (F 2P-1-r, B r); on the last
   rank the first F0 and B1 run apart, as DualPipeV runs them
5. ``nB1F1B0`` P - r - 1 times: backward of stage 2P-1-r, F&B of (F 2P-1-r, B r)
6. ``nB1B0``   r + 1 pairs of backwards; from the middle one on, W deferred
7. ``nWB0``    P - r - 1 times: one W, a backward of stage r (W deferred)
8. ``nW``      the remaining W

Deadlock freedom: sends never block (tags unique within the step), so a rank blocks only on a receive;
:func:`simulate_dualpipev` runs every rank's list against the others' and raises on a cycle of receives, an unmatched
transfer, a backward before its forward or a W before its backward.
"""

from collections import deque
from dataclasses import dataclass

from ep_overlap_lab.program.pipeline import PipelineStep, Transfer
from megatron.bridge.training.ep_overlap.program.pipeline import BACKWARD, FORWARD, Phase

VIRTUAL_STAGES = 2


def stage_of(rank: int, virtual: int, pipeline_size: int) -> int:
    """The global stage of ``rank``'s virtual stage (0: going out, 1: coming back)."""
    return rank if virtual == 0 else 2 * pipeline_size - 1 - rank


def rank_of(stage: int, pipeline_size: int) -> int:
    return stage if stage < pipeline_size else 2 * pipeline_size - 1 - stage


def dualpipev_problem(pipeline_size: int, num_microbatches: int) -> str | None:
    """Why DualPipeV cannot run (P, N), with the fix; else None."""
    if pipeline_size < 2:
        return f"DualPipeV needs pipeline_model_parallel_size >= 2 (got {pipeline_size}); fix: use 1F1B at PP = 1"
    if num_microbatches < 2 * pipeline_size:
        return (
            f"DualPipeV needs num_microbatches >= 2 x pipeline_model_parallel_size = {2 * pipeline_size} "
            f"(got {num_microbatches}); fix: raise the global batch size or use the 1F1B schedule"
        )
    return None


def _transfers(kind: str, m: int, virtual: int, rank: int, P: int) -> tuple[list[Transfer], list[Transfer]]:
    s = stage_of(rank, virtual, P)
    source, target = (s - 1, s + 1) if kind == FORWARD else (s + 1, s - 1)
    recv, send = [], []
    if 0 <= source < 2 * P and rank_of(source, P) != rank:
        recv.append(Transfer(kind, m, s, rank_of(source, P)))
    if 0 <= target < 2 * P and rank_of(target, P) != rank:
        send.append(Transfer(kind, m, target if kind == FORWARD else s - 1, rank_of(target, P)))
    return recv, send


class _Builder:
    """Appends steps, taking each stage's next microbatch and queueing deferred W in order."""

    def __init__(self, P: int, rank: int, overlap: bool):
        self.P, self.rank, self.overlap = P, rank, overlap
        self.next = {(FORWARD, v): 0 for v in range(VIRTUAL_STAGES)} | {(BACKWARD, v): 0 for v in range(2)}
        self.queued: deque[tuple[int, int]] = deque()
        self.steps: list[PipelineStep] = []

    def _take(self, kind: str, virtual: int) -> tuple[int, int]:
        m = self.next[kind, virtual]
        self.next[kind, virtual] += 1
        return m, virtual

    def _step(self, phase: Phase, f: tuple[int, int] | None, b: tuple[int, int] | None) -> None:
        recv, send = [], []
        for kind, unit in ((FORWARD, f), (BACKWARD, b)):
            if unit is not None:
                got, out = _transfers(kind, *unit, self.rank, self.P)
                recv, send = recv + got, send + out
        self.steps.append(PipelineStep(phase, f, b, tuple(recv), tuple(send)))

    def forward(self, phase: Phase, virtual: int) -> None:
        self._step(phase, self._take(FORWARD, virtual), None)

    def backward(self, phase: Phase, virtual: int, defer_weight: bool = False) -> None:
        b = self._take(BACKWARD, virtual)
        if defer_weight:
            self.queued.append(b)
        self._step(phase, None, b)

    def weight(self, phase: Phase) -> None:
        self.steps.append(PipelineStep(phase, None, None, weight=self.queued.popleft()))

    def forward_backward(self, f_virtual: int, b_virtual: int) -> None:
        """F&B: one paired step with overlap; forward, then backward, without."""
        f, b = self._take(FORWARD, f_virtual), self._take(BACKWARD, b_virtual)
        if self.overlap:
            self._step(Phase.PAIRED, f, b)
        else:
            self._step(Phase.STEADY, f, None)
            self._step(Phase.STEADY, None, b)


def dualpipev_schedule(
    pipeline_size: int, num_microbatches: int, rank: int, *, overlap: bool = True
) -> list[PipelineStep]:
    """The ordered steps of pipeline rank ``rank`` (see the module docstring); ``overlap=False`` splits each F&B."""
    P, N, r = pipeline_size, num_microbatches, rank
    if (problem := dualpipev_problem(P, N)) is not None or not 0 <= r < P:
        raise ValueError(problem or f"no pipeline rank {r} of {P}")
    last = r == P - 1
    run = _Builder(P, r, overlap)
    # 1. nF0: warm-up forwards of the outgoing stage
    for _ in range(2 * (P - r - 1)):
        run.forward(Phase.WARMUP, 0)
    # 2. nF0F1: forwards of both stages, alternating
    for _ in range(r + 1):
        run.forward(Phase.WARMUP, 0)
        run.forward(Phase.WARMUP, 1)
    # 3. nB1W1F1: the first backwards of the returning stage, each W deferred to a gap before the next forward
    for _ in range(P - r - 1):
        run.backward(Phase.WARMUP, 1, defer_weight=True)
        run.weight(Phase.WARMUP)
        run.forward(Phase.WARMUP, 1)
    # 4. nF0B1F1B0: the steady phase, every step an F&B of the two stages
    for i in range(N - 2 * P + r + 1):
        if i == 0 and last:  # stage P's first gradient arrives late: its forward goes first, alone
            run.forward(Phase.STEADY, 0)
            run.backward(Phase.STEADY, 1)
        else:
            run.forward_backward(0, 1)
        run.forward_backward(1, 0)
    # 5. nB1F1B0: the outgoing stage has run its last forward
    for _ in range(P - r - 1):
        run.backward(Phase.COOLDOWN, 1)
        run.forward_backward(1, 0)
    # 6. nB1B0: the last backwards of the returning stage; from the middle on, W deferred
    defer = False
    for i in range(r + 1):
        defer = defer or (i == (r + 1) // 2 and r % 2 == 1)
        run.backward(Phase.COOLDOWN, 1, defer_weight=defer)
        defer = defer or (i == (r + 1) // 2 and r % 2 == 0)
        run.backward(Phase.COOLDOWN, 0, defer_weight=defer)
    # 7. nWB0: a W fills the wait for each remaining gradient
    for _ in range(P - r - 1):
        run.weight(Phase.COOLDOWN)
        run.backward(Phase.COOLDOWN, 0, defer_weight=True)
    # 8. nW: the remaining W
    while run.queued:
        run.weight(Phase.COOLDOWN)
    return run.steps


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
