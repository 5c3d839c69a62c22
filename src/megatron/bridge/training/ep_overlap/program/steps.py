"""One step of the schedule program (no torch): the windows of :class:`Op` s (ops that may overlap) of a step of each
:class:`StepKind` (a forward, a backward, one of each paired layer by layer, or two of one direction), for the units
and :class:`ChunkShape` s it is given. :func:`windows_of` is what Megatron-Core's driver runs per call."""

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from megatron.bridge.training.ep_overlap.options import WGRAD_WINDOWS
from megatron.bridge.training.ep_overlap.program.ops import (
    COMPUTE,
    LAUNCH,
    OPS,
    WAIT,
    WGRAD,
    Op,
    OpKind,
    Window,
    _attention_wgrad,
    _backward_begin,
    _backward_end,
    _combine_bwd,
    _experts_bwd,
    _experts_dgrad,
    _pre_dispatch_bwd,
    _replay_ahead,
)
from megatron.bridge.training.ep_overlap.program.pipeline import BACKWARD, FORWARD
from megatron.bridge.training.ep_overlap.program.replay import (
    backward_begin,
    backwards_ahead,
    replay_before_backward,
    replay_step,
    replayed_step,
    replays_ahead,
)

__all__ = ["OPS", "ChunkShape", "Op", "OpKind", "StepKind", "Window", "step_kind", "windows_of"]


class StepKind(StrEnum):
    """What a step pairs: one forward or backward alone, a forward with a backward, or two of a kind."""

    FORWARD = "forward"
    BACKWARD = "backward"
    PAIRED = "paired"
    FORWARD_PAIR = "forward_pair"
    BACKWARD_PAIR = "backward_pair"


@dataclass(frozen=True)
class ChunkShape:
    """What the program needs of a model chunk: its ends, which layers are MoE, its recomputed segments."""

    first: bool
    last: bool
    moe: tuple[bool, ...]
    segments: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, chunk) -> "ChunkShape":
        segments = tuple(tuple(s) for s in getattr(chunk, "recompute_segments", ()))
        moe = tuple(bool(x.is_moe) for x in chunk.layers)
        return cls(bool(chunk.pre_process), bool(chunk.post_process), moe, segments)

    def replayed(self, layer: int) -> tuple[int, int] | None:
        """The recomputed segment whose last layer is ``layer``."""
        return next((s for s in self.segments if s[1] - 1 == layer), None)


class _Output:
    """Where a forward unit's current activation comes from: the chunk's start, a combine still to finish, or done."""

    def __init__(self, unit: int, shape: ChunkShape):
        self.unit, self.shape, self.pending = unit, shape, "begin"

    def take(self) -> list[Op]:
        pending, self.pending = self.pending, None
        if pending == "begin":
            return [
                Op(COMPUTE, "embedding", self.unit) if self.shape.first else Op(WAIT, "recv_activation", self.unit)
            ]
        return (
            []
            if pending is None
            else [Op(WAIT, "combine", self.unit, pending), Op(COMPUTE, "combine", self.unit, pending)]
        )

    def end(self) -> list[Op]:
        last = Op(COMPUTE, "head", self.unit) if self.shape.last else Op(LAUNCH, "send_activation", self.unit)
        return self.take() + [last]


def _to_dispatch(out: _Output, j: int, moe: bool) -> list[Op]:
    u = out.unit
    split = [Op(LAUNCH, "split", u, j), Op(WAIT, "split", u, j)] if moe else []
    return out.take() + [Op(COMPUTE, "pre_dispatch", u, j), *split, Op(LAUNCH, "dispatch", u, j)]


def _to_combine(u: int, j: int) -> list[Op]:
    return [Op(WAIT, "dispatch", u, j), Op(COMPUTE, "experts", u, j), Op(LAUNCH, "combine", u, j)]


def _layer_forward(out: _Output, j: int, moe: bool) -> list[Op]:
    ops = _to_dispatch(out, j, moe) + _to_combine(out.unit, j)
    out.pending = j
    return ops


def _layer_backward(u: int, k: int, shape: ChunkShape, delay_wgrad: bool) -> list[Op]:
    ops = (
        replay_before_backward(u, k, shape)
        + _combine_bwd(u, k)
        + _experts_bwd(u, k, shape.moe[k], delay_wgrad)
        + _pre_dispatch_bwd(u, k)
    )
    return ops + _attention_wgrad([u], k, delay_wgrad)


def unit_ops(role: str, u: int, shape: ChunkShape, delay_wgrad: bool) -> list[Op]:
    """One unit's forward (``F``) or backward (``B``) through its chunk, nothing beside it."""
    if role == FORWARD:
        out = _Output(u, shape)
        return [op for j, moe in enumerate(shape.moe) for op in _layer_forward(out, j, moe)] + out.end()
    layers = [op for k in reversed(range(len(shape.moe))) for op in _layer_backward(u, k, shape, delay_wgrad)]
    return [_backward_begin(u, shape), *layers, _backward_end(u, shape)]


@dataclass(frozen=True)
class StepWork:
    """What one step lays out: forward units ``f`` (chunk shape ``fs``), backward units ``b`` (``bs``), wgrad."""

    f: tuple[int, ...]
    b: tuple[int, ...]
    fs: ChunkShape | None
    bs: ChunkShape | None
    delay_wgrad: bool
    window: int | None


def _alone(w: StepWork) -> list[Window]:
    role, (u,), shape = (FORWARD, w.f, w.fs) if w.f else (BACKWARD, w.b, w.bs)
    if role == BACKWARD and replays_ahead(shape):
        return backwards_ahead(w.b, shape, w.delay_wgrad)
    return [Window("alone", tuple(unit_ops(role, u, shape, w.delay_wgrad)))]


@dataclass(frozen=True)
class LayerPair:
    """One paired layer step: F's layer ``forward`` with B's layer ``backward`` (chunk positions); ``pending``: B's
    layer whose attention wgrad is still to run; ``replay``: the segment B's layer ends, replayed in this step."""

    forward: int
    backward: int
    forward_moe: bool
    backward_moe: bool
    pending: int | None
    delay_wgrad: bool
    window: int | None
    replay: tuple[int, int] | None = None
    replayed: bool = False  # B's layer was replayed a step ahead: its replay's combine is in flight
    replay_next: int | None = None  # the layer below whose replay this step starts (one-layer segments)


def layer_step(outs, b: Sequence[int], pair: LayerPair) -> list[Window]:
    """The paired layer step ``pair``: F's units (``outs``, where each one's input comes from) with B's ``b``."""
    if pair.replayed:
        return replayed_step(outs, b, pair)
    ahead = [] if pair.replay_next is None else [Window(f"B L{pair.replay_next} replay ahead", tuple(
        op for u in b for op in _replay_ahead(u, pair.replay_next)))]  # fmt: skip
    if pair.replay is not None:
        return replay_step(outs, b, pair) + ahead
    return _layer_step(outs, b, pair) + ahead


def _layer_step(outs, b: Sequence[int], pair: LayerPair) -> list[Window]:
    j, k, moe_f, moe_b = pair.forward, pair.backward, pair.forward_moe, pair.backward_moe
    delay_wgrad, window = pair.delay_wgrad, pair.window
    f = [out.unit for out in outs]
    wgrad = _attention_wgrad(b, pair.pending, delay_wgrad)
    early = window == 1 and not moe_f  # no split sizes to hide: the wgrad goes beside B.combine backward
    w1 = [op for u in b for op in _combine_bwd(u, k)] + (wgrad if early else [])
    w1 += [op for out in outs for op in out.take() + [Op(COMPUTE, "pre_dispatch", out.unit, j)]]
    w1 += [Op(LAUNCH, "split", u, j) for u in f] if moe_f else []
    w1 += wgrad if window == 1 and not early else []
    w2 = f_dispatch_beside_b_experts_bwd(f, b, pair, wgrad if window == 2 else [])
    w3 = [Op(LAUNCH, "dispatch_bwd", u, k) for u in b]
    w3 += [Op(WGRAD, "experts", u, k) for u in b] if delay_wgrad and moe_b else []
    w3 += [op for u in f for op in (Op(WAIT, "dispatch", u, j), Op(COMPUTE, "experts", u, j))]
    w4 = [Op(LAUNCH, "combine", u, j) for u in f] + [op for u in b for op in _pre_dispatch_bwd(u, k)]
    for out in outs:
        out.pending = j
    label = f"F L{j} + B L{k}"
    return [Window(f"{label} {i}", tuple(ops)) for i, ops in enumerate((w1, w2, w3, w4), 1)]


def f_dispatch_beside_b_experts_bwd(f: Sequence[int], b: Sequence[int], pair: LayerPair, wgrad: list[Op]) -> list[Op]:
    """Window 2: F's dispatch beside B's expert backward; a device lane moves F's split-size sync after the latter."""
    j, k = pair.forward, pair.backward
    ops = [Op(WAIT, "split", u, j) for u in f] if pair.forward_moe else []
    ops += [Op(LAUNCH, "dispatch", u, j) for u in f] + wgrad
    return ops + [op for u in b for op in _experts_dgrad(u, k)]


def _paired(w: StepWork) -> list[Window]:
    """Forward of ``f`` with backward of ``b``, layer by layer; the longer chunk's extra layers run unpaired."""
    f, b, fs, bs, delay_wgrad, window = w.f, w.b, w.fs, w.bs, w.delay_wgrad, w.window
    outs = [_Output(u, fs) for u in f]
    nf, nb = len(fs.moe), len(bs.moe)
    paired = min(nf, nb)
    ahead = {k for k in range(nb - paired, nb) if (k, k + 1) in bs.segments}
    windows = [backward_begin(b, bs, replay_top=nb - 1 in ahead)]
    pending = None
    for j in range(paired):
        k = nb - 1 - j
        pair = LayerPair(
            forward=j, backward=k, forward_moe=fs.moe[j], backward_moe=bs.moe[k], pending=pending,
            delay_wgrad=delay_wgrad, window=window, replay=None if k in ahead else bs.replayed(k), replayed=k in ahead,
            replay_next=k - 1 if k - 1 in ahead else None,
        )  # fmt: skip
        windows += layer_step(outs, b, pair)
        pending = k
    extra = []
    for j in range(min(nf, nb), nb):
        k = nb - 1 - j
        extra += _attention_wgrad(b, pending, delay_wgrad)
        extra += [op for u in b for op in _layer_backward(u, k, bs, delay_wgrad)]
        pending = None
    for j in range(min(nf, nb), nf):
        extra += [op for out in outs for op in _layer_forward(out, j, fs.moe[j]) + out.take()]
    # P2P in Megatron-Core's order (activation, then gradient); B's last attention wgrad beside F's last combine
    end = [] if fs.last else [op for out in outs for op in out.end()]
    end += [_backward_end(u, bs) for u in b] + _attention_wgrad(b, pending, delay_wgrad)
    end += [op for out in outs for op in out.end()] if fs.last else []
    return windows + [Window("unpaired layers", tuple(extra)), Window("ends", tuple(end))]


def _forward_pair(w: StepWork) -> list[Window]:
    f, fs = w.f, w.fs
    outs = [_Output(u, fs) for u in f]
    windows = []
    for j, moe in enumerate(fs.moe):
        ops = [op for out in outs for op in _to_dispatch(out, j, moe)] + [op for u in f for op in _to_combine(u, j)]
        for out in outs:
            out.pending = j
        windows.append(Window(f"F L{j} x2", tuple(ops)))
    return windows + [Window("ends", tuple(op for out in outs for op in out.end()))]


def _backward_pair(w: StepWork) -> list[Window]:
    """Two backwards interleaved layer by layer; every parameter gets the first one's contribution first."""
    b, bs, delay_wgrad = w.b, w.bs, w.delay_wgrad
    if replays_ahead(bs):
        return backwards_ahead(b, bs, delay_wgrad)
    x, y = b
    windows = [Window("B begin", (_backward_begin(x, bs), _backward_begin(y, bs)))]
    pending = None
    for k in reversed(range(len(bs.moe))):
        moe = bs.moe[k]
        ops = replay_before_backward(x, k, bs) + replay_before_backward(y, k, bs)
        ops += _combine_bwd(x, k) + _attention_wgrad(b, pending, delay_wgrad) + _combine_bwd(y, k)
        ops += _experts_bwd(x, k, moe, delay_wgrad) + _experts_bwd(y, k, moe, delay_wgrad)
        windows.append(Window(f"B L{k} x2", tuple(ops + _pre_dispatch_bwd(x, k) + _pre_dispatch_bwd(y, k))))
        pending = k
    ends = _attention_wgrad(b, pending, delay_wgrad) + [_backward_end(x, bs), _backward_end(y, bs)]
    return windows + [Window("ends", tuple(ends))]


_BUILD = {
    StepKind.FORWARD: _alone,
    StepKind.BACKWARD: _alone,
    StepKind.PAIRED: _paired,
    StepKind.FORWARD_PAIR: _forward_pair,
    StepKind.BACKWARD_PAIR: _backward_pair,
}


def step_kind(forwards: int, backwards: int) -> StepKind:
    """The kind of an overlapped step of ``forwards`` forward and ``backwards`` backward units (two at most)."""
    if forwards and backwards:
        return StepKind.PAIRED
    if forwards:
        return StepKind.FORWARD_PAIR if forwards == 2 else StepKind.FORWARD
    return StepKind.BACKWARD_PAIR if backwards == 2 else StepKind.BACKWARD


def windows_of(
    kind: str, f: Sequence[int], b: Sequence[int], fs, bs, *, delay_wgrad: bool, window: int | None
) -> tuple[Window, ...]:
    """The windows of one step of ``kind`` (what Megatron-Core's driver runs per call); a ValueError when a backward
    defers its wgrad and ``window`` is not 1 or 2 (resolve auto before). Built once per distinct step."""
    if delay_wgrad and b:
        _check_window(window)
    key = (kind, StepWork(tuple(f), tuple(b), fs, bs, delay_wgrad, window))
    if key not in _BUILT:
        _BUILT[key] = tuple(_BUILD[kind](key[1]))
    return _BUILT[key]


_BUILT: dict[tuple[str, StepWork], tuple[Window, ...]] = {}  # a model has a handful of distinct steps


def _check_window(window) -> None:
    if window not in WGRAD_WINDOWS:
        raise ValueError(
            f"attention_wgrad_window={window!r}: the program puts each delayed attention wgrad in window 1 or 2 of "
            "the next layer step; resolve an automatic window before asking for it"
        )
