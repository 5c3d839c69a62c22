"""The whole-step schedule program (no torch): a rank's training step as data, read by the lab's engine and planner,
the scripts and the tests. :func:`program` yields the rank's :class:`Step` s, each with its units, P2P transfers and
windows of ops (the payload's :func:`~megatron.bridge.training.ep_overlap.program.steps.windows_of`, the same steps
Megatron-Core's driver runs). Edge pairing, chunking, forward-only steps and pipeline parallelism are inputs here;
nothing downstream branches on them."""

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ep_overlap_lab.program.pipeline import Transfer, pipeline_schedule
from ep_overlap_lab.program.units import Unit, units
from megatron.bridge.training.ep_overlap.program.ops import PLAIN, Op, Window
from megatron.bridge.training.ep_overlap.program.pipeline import BACKWARD, FORWARD, Phase
from megatron.bridge.training.ep_overlap.program.steps import (
    ChunkShape,
    StepKind,
    _check_window,
    step_kind,
    windows_of,
)

__all__ = ["Step", "StepUnit", "format_program", "program"]


@dataclass(frozen=True)
class StepUnit:
    """A unit a step runs; ``done``: this step is the unit's last on that chunk."""

    role: str
    unit: int
    microbatch: int
    half: int | None
    virtual: int
    done: bool


@dataclass(frozen=True)
class Step:
    """One step of the program: its kind, units, P2P transfers and windows of ops."""

    kind: StepKind
    phase: "Phase"
    units: tuple[StepUnit, ...]
    recv: tuple[Transfer, ...]
    send: tuple[Transfer, ...]
    windows: tuple[Window, ...]
    # the backward defers weight gradients to its ``wgrad`` ops: consumers read it here, not from the options
    delay_wgrad: bool = False

    @property
    def ops(self) -> Iterator[Op]:
        return (op for window in self.windows for op in window.ops)

    @functools.cached_property
    def plain(self) -> bool:
        """Overlap off: whole chunks through ordinary autograd (cached: consumers read it per op)."""
        return any(op.kind == PLAIN for op in self.ops)

    def unit_for(self, transfer: Transfer) -> StepUnit:
        return next(u for u in self.units if u.role == transfer.kind and u.microbatch == transfer.microbatch)


def _members(s, of: dict[int, list[tuple[int, Unit]]], forward_only: bool) -> list[StepUnit]:
    sides = [(FORWARD, s.forward), (BACKWARD, s.backward), (FORWARD if s.forward else BACKWARD, s.partner)]
    members = [
        StepUnit(role, u, unit.microbatch, unit.half, at[1], role == BACKWARD or forward_only)
        for role, at in sides
        if at is not None
        for u, unit in of[at[0]]
    ]
    if len({m.unit for m in members}) != len(members):  # ops name their unit: a step holds each unit once
        raise RuntimeError(f"pipeline step {s} runs a unit twice")
    return members


def program(
    options,
    shapes: Sequence[ChunkShape],
    num_microbatches: int,
    *,
    pipeline_size: int = 1,
    rank: int = 0,
    forward_only: bool = False,
    delay_wgrad: bool | None = None,
    window: int | None = None,
) -> Iterator[Step]:
    """This rank's steps; ``shapes``: its chunks in virtual-stage order; ``delay_wgrad``/``window`` as the settings
    resolved them (None: the options'). A ValueError when a deferred wgrad's window is not 1 or 2."""
    overlap = options.overlap and not (forward_only and pipeline_size > 1)
    chunks = options.moe_ep_overlap_chunks if overlap else 1
    delay_wgrad = overlap and (options.delay_wgrad if delay_wgrad is None else delay_wgrad)
    window = options.attention_wgrad_window if window is None else window
    if delay_wgrad and not forward_only:  # the only steps that read the window
        _check_window(window)
    of: dict[int, list[tuple[int, Unit]]] = {}
    for u, unit in enumerate(units(num_microbatches, chunks, forward_only=forward_only)):
        of.setdefault(unit.microbatch, []).append((u, unit))
    steps = pipeline_schedule(
        pipeline_size, len(shapes), num_microbatches, rank, overlap=overlap, forward_only=forward_only,
        edge_pairing=options.edge_pairing,
    )  # fmt: skip
    for s in steps:
        members = _members(s, of, forward_only)
        f = [m.unit for m in members if m.role == FORWARD]
        b = [m.unit for m in members if m.role == BACKWARD]
        fs = shapes[s.forward[1]] if s.forward else None
        bs = shapes[s.backward[1]] if s.backward else (shapes[s.partner[1]] if s.partner else None)
        if not overlap:
            kind = StepKind.FORWARD if f else StepKind.BACKWARD
            windows = [Window("plain", (Op(PLAIN, kind.value, members[0].unit),))]
        else:
            kind = step_kind(len(f), len(b))
            windows = windows_of(kind, f, b, fs, bs, delay_wgrad=delay_wgrad, window=window)
        phase = s.phase if overlap else Phase.PLAIN
        yield Step(kind, phase, tuple(members), s.recv, s.send, tuple(windows), delay_wgrad=delay_wgrad)


def format_program(steps: Sequence[Step], rank: int, pipeline_size: int) -> str:
    """One line per step (phase, kind, units as F/B u<unit>=m<microbatch>[.half] c<chunk>, P2P), one per window."""

    def who(m: StepUnit) -> str:
        half = "" if m.half is None else f".{m.half}"
        return f"{m.role} u{m.unit}=m{m.microbatch}{half} c{m.virtual * pipeline_size + rank}"

    def p2p(direction: str, transfers) -> list[str]:
        return [f"{direction}{t.kind}m{t.microbatch}c{t.chunk}@r{t.peer}" for t in transfers]

    lines = [f"pipeline rank {rank}:"]
    for i, s in enumerate(steps):
        work = " + ".join(who(m) for m in s.units)
        lines.append(
            f"  {i:3d} {s.phase:8s} {s.kind:13s} {work} {' '.join(p2p('<', s.recv) + p2p('>', s.send))}".rstrip()
        )
        lines += [f"        {w.label}: " + "; ".join(map(str, w.ops)) for w in s.windows if w.ops]
    return "\n".join(lines)
