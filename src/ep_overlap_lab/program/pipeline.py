"""The per-rank order of a training step under interleaved pipeline parallelism, as data (no torch), in
Megatron-Core's layout (rank r holds chunk ``v * P + r``); PP = 1 is P = V = 1. Warm-up is Megatron-Core's count
plus one forward with overlap, so no step pairs a microbatch's forward with its own backward. Deadlock freedom: sends
never block (tags unique within the step), receives are posted a step ahead, and an all-to-all spans one pipeline
stage, whose ranks run the same list; :func:`simulate` checks it. Roles, phases and step types are the payload's."""

from megatron.bridge.training.ep_overlap.program.pipeline import (
    BACKWARD,
    FORWARD,
    Phase,
    PipelineStep,
    Transfer,
)


def virtual_order(num_microbatches: int, pipeline_size: int, virtual_size: int) -> list[tuple[int, int]]:
    """(microbatch, virtual stage) in forward order; the backward reverses the virtual stage."""
    order, start = [], 0
    while start < num_microbatches:
        # A last group smaller than P would reach a stage before the pipeline filled it: it joins the one before
        end = num_microbatches if num_microbatches - start < 2 * pipeline_size else start + pipeline_size
        order.extend((m, v) for v in range(virtual_size) for m in range(start, end))
        start = end
    return order


def warmup_count(pipeline_size: int, virtual_size: int, num_microbatches: int, rank: int, overlap: bool) -> int:
    """Megatron-Core's count, raised where a larger last group needs more forwards before its first backward."""
    forwards = virtual_order(num_microbatches, pipeline_size, virtual_size)
    position = {f: i for i, f in enumerate(forwards)}
    # Backward k must come after its own forward; paired with forward W + k it needs a strictly earlier one.
    lag = max(position[(m, virtual_size - 1 - v)] - k for k, (m, v) in enumerate(forwards))
    if virtual_size == 1 and not overlap:
        return min(pipeline_size - rank - 1, len(forwards))
    count = 2 * (pipeline_size - rank - 1) + max((virtual_size - 1) * pipeline_size, lag) + int(overlap)
    return min(count, len(forwards))


def _forward_transfers(m: int, v: int, rank: int, P: int, V: int) -> tuple[Transfer | None, Transfer | None]:
    chunk = v * P + rank
    recv = None if chunk == 0 else Transfer(FORWARD, m, chunk, (rank - 1) % P)
    send = None if chunk == P * V - 1 else Transfer(FORWARD, m, chunk + 1, (rank + 1) % P)
    return recv, send


def _backward_transfers(m: int, v: int, rank: int, P: int, V: int) -> tuple[Transfer | None, Transfer | None]:
    chunk = v * P + rank
    recv = None if chunk == P * V - 1 else Transfer(BACKWARD, m, chunk, (rank + 1) % P)
    send = None if chunk == 0 else Transfer(BACKWARD, m, chunk - 1, (rank - 1) % P)
    return recv, send


def pipeline_schedule(
    pipeline_size: int,
    virtual_size: int,
    num_microbatches: int,
    rank: int,
    *,
    overlap: bool,
    forward_only: bool = False,
    edge_pairing: bool = False,
) -> list[PipelineStep]:
    """The ordered steps of pipeline rank ``rank``; ``edge_pairing`` (PP = 1, overlap, N >= 2) pairs lone steps."""
    P, V, N = pipeline_size, virtual_size, num_microbatches
    if P < 1 or V < 1 or N < 1 or not 0 <= rank < P:
        raise ValueError(f"no schedule for pipeline_size={P}, virtual_size={V}, microbatches={N}, rank={rank}")
    if edge_pairing and overlap and not forward_only and P == V == 1 and N >= 2:
        return edge_paired_schedule(N)
    if forward_only and overlap and P == V == 1:
        return forward_paired_schedule(N)
    forwards = virtual_order(N, P, V)
    backwards = [(m, V - 1 - v) for m, v in forwards]
    total, warmup = len(forwards), warmup_count(P, V, N, rank, overlap)

    def step(phase: str, f: tuple[int, int] | None, b: tuple[int, int] | None) -> PipelineStep:
        recv, send = [], []
        if f is not None:
            got, out = _forward_transfers(*f, rank, P, V)
            recv += [got] if got else []
            send += [out] if out else []
        if b is not None:
            got, out = _backward_transfers(*b, rank, P, V)
            recv += [got] if got else []
            send += [out] if out else []
        return PipelineStep(phase, f, b, tuple(recv), tuple(send))

    if forward_only:
        return [step(Phase.FORWARD, f, None) for f in forwards]
    steps = [step(Phase.WARMUP, forwards[k], None) for k in range(warmup)]
    for k in range(total - warmup):
        if overlap:
            steps.append(step(Phase.PAIRED, forwards[warmup + k], backwards[k]))
        else:
            steps.append(step(Phase.STEADY, forwards[warmup + k], None))
            steps.append(step(Phase.STEADY, None, backwards[k]))
    steps += [step(Phase.COOLDOWN, None, backwards[k]) for k in range(total - warmup, total)]
    return steps


def simulate(pipeline_size: int, virtual_size: int, num_microbatches: int, *, overlap: bool) -> None:
    """Runs every rank's list against the others' (a step waits until each transfer it receives was sent); a
    RuntimeError on deadlock (naming each blocked rank and transfer) or a backward before its forward."""
    schedules = [
        pipeline_schedule(pipeline_size, virtual_size, num_microbatches, r, overlap=overlap)
        for r in range(pipeline_size)
    ]
    position = [0] * pipeline_size
    sent: set[tuple[str, int, int]] = set()
    forwarded: list[set[tuple[int, int]]] = [set() for _ in range(pipeline_size)]
    while True:
        progressed = False
        for r, steps in enumerate(schedules):
            while position[r] < len(steps):
                s = steps[position[r]]
                if any((t.kind, t.microbatch, t.chunk) not in sent for t in s.recv):
                    break
                if s.backward is not None and s.backward not in forwarded[r]:
                    raise RuntimeError(f"rank {r} step {position[r]}: backward of {s.backward} before its forward")
                if s.forward is not None:
                    forwarded[r].add(s.forward)
                sent.update((t.kind, t.microbatch, t.chunk) for t in s.send)
                position[r] += 1
                progressed = True
        if all(p == len(s) for p, s in zip(position, schedules)):
            return
        if not progressed:
            blocked = [
                f"rank {r} at step {position[r]} waits for "
                + ", ".join(
                    f"{t.kind}(microbatch {t.microbatch}, chunk {t.chunk}) from rank {t.peer}"
                    for t in schedules[r][position[r]].recv
                    if (t.kind, t.microbatch, t.chunk) not in sent
                )
                for r in range(pipeline_size)
                if position[r] < len(schedules[r])
            ]
            raise RuntimeError("the pipeline schedule deadlocks: " + "; ".join(blocked))


def forward_paired_schedule(num_microbatches: int) -> list[PipelineStep]:
    """Forward-only at PP = 1 with overlap: F(0) with F(1), F(2) with F(3), ...; an odd last one alone."""
    n = num_microbatches
    steps = [PipelineStep(Phase.FORWARD, (m, 0), None, partner=(m + 1, 0)) for m in range(0, n - 1, 2)]
    return steps + ([PipelineStep(Phase.FORWARD, (n - 1, 0), None)] if n % 2 else [])


def edge_paired_schedule(num_microbatches: int) -> list[PipelineStep]:
    """PP = 1 with nothing unpaired: F(0) with F(1); F(i+2) with B(i) for i = 0..N-3; B(N-2) with B(N-1)."""
    n = num_microbatches
    return [
        PipelineStep(Phase.WARMUP, (0, 0), None, partner=(1, 0)),
        *(PipelineStep(Phase.PAIRED, (i + 2, 0), (i, 0)) for i in range(n - 2)),
        PipelineStep(Phase.COOLDOWN, None, (n - 2, 0), partner=(n - 1, 0)),
    ]
