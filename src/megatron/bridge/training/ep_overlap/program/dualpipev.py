"""DualPipeV's per-rank op list, as data (no torch).

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

Deadlock freedom: sends never block (tags unique within the step), so a rank blocks only on a receive; the lab's
``simulate_dualpipev`` runs every rank's list against the others' (no cycle of receives, every transfer matched, each
backward after its forward and each W after its backward) for P in {2, 4, 8} and N from 2P.
"""

from collections import deque

from megatron.bridge.training.ep_overlap.program.pipeline import BACKWARD, FORWARD, Phase, PipelineStep, Transfer

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
