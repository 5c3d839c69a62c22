"""Full recompute in the program (no torch): a segment's forward is replayed before its last layer's backward. In a
paired step a one-layer segment is replayed a layer ahead (:func:`replayed_step`), a longer one just in time
(:func:`replay_step`); lone backwards replay ahead when every segment is one layer (:func:`backwards_ahead`)."""

from collections.abc import Sequence

from megatron.bridge.training.ep_overlap.program.ops import (
    COMPUTE,
    LAUNCH,
    WAIT,
    WGRAD,
    Op,
    Window,
    _attention_wgrad,
    _backward_begin,
    _backward_end,
    _combine_bwd,
    _experts_bwd,
    _experts_dgrad,
    _pre_dispatch_bwd,
    _replay_below,
    _replay_layer,
    _replay_output,
    _replay_start,
    _replay_to_combine,
    _replay_to_dispatch,
)


def replay_before_backward(u: int, k: int, shape) -> list[Op]:
    """The replay that comes before layer ``k``'s backward: the whole segment ``k`` ends (none if it ends none)."""
    segment = shape.replayed(k)
    return [] if segment is None else _replay_below(u, segment) + _replay_layer(u, k)


def replay_step(outs, b: Sequence[int], pair) -> list[Window]:
    """The paired layer step whose B layer ends a segment replayed just in time, in five windows; the attention
    wgrad goes in window 4 whatever ``attention_wgrad_window`` says."""
    j, k, moe_f, delay_wgrad = pair.forward, pair.backward, pair.forward_moe, pair.delay_wgrad
    f = [out.unit for out in outs]
    w1 = [op for u in b for op in _replay_below(u, pair.replay) + _replay_to_dispatch(u, k)]
    w1 += [op for out in outs for op in out.take() + [Op(COMPUTE, "pre_dispatch", out.unit, j)]]
    w1 += [Op(LAUNCH, "split", u, j) for u in f] if moe_f else []
    w2 = [Op(WAIT, "split", u, j) for u in f] if moe_f else []
    w2 += [Op(LAUNCH, "dispatch", u, j) for u in f] + [op for u in b for op in _replay_to_combine(u, k)]
    w3 = [op for u in f for op in (Op(WAIT, "dispatch", u, j), Op(COMPUTE, "experts", u, j))]
    w3 += [Op(LAUNCH, "combine", u, j) for u in f]
    w3 += [op for u in b for op in _replay_output(u, k) + _combine_bwd(u, k)]
    w4 = _attention_wgrad(b, pair.pending, delay_wgrad) + [op for u in b for op in _experts_dgrad(u, k)]
    w4 += [Op(LAUNCH, "dispatch_bwd", u, k) for u in b]
    w4 += [Op(WGRAD, "experts", u, k) for u in b] if delay_wgrad and pair.backward_moe else []
    w5 = [op for u in b for op in _pre_dispatch_bwd(u, k)]
    for out in outs:
        out.pending = j
    label = f"F L{j} + B L{k} replay"
    return [Window(f"{label} {i}", tuple(ops)) for i, ops in enumerate((w1, w2, w3, w4, w5), 1)]


def replayed_step(outs, b: Sequence[int], pair) -> list[Window]:
    """The paired layer step whose B layer was replayed a step ahead; it starts the replay of ``replay_next``."""
    j, k, moe_f, delay_wgrad, below = pair.forward, pair.backward, pair.forward_moe, pair.delay_wgrad, pair.replay_next
    f = [out.unit for out in outs]
    w1 = [op for out in outs for op in out.take() + [Op(COMPUTE, "pre_dispatch", out.unit, j)]]
    w1 += [Op(LAUNCH, "split", u, j) for u in f] if moe_f else []
    w2 = [op for u in b for op in _replay_output(u, k) + _combine_bwd(u, k)]
    w2 += [Op(WAIT, "split", u, j) for u in f] if moe_f else []
    w2 += [Op(LAUNCH, "dispatch", u, j) for u in f] + _attention_wgrad(b, pair.pending, delay_wgrad)
    if below is not None:
        w2 += [op for u in b for op in _replay_start(u, below)]
    w3 = [op for u in b for op in _experts_dgrad(u, k)] + [Op(LAUNCH, "dispatch_bwd", u, k) for u in b]
    w3 += [Op(WGRAD, "experts", u, k) for u in b] if delay_wgrad and pair.backward_moe else []
    w3 += [op for u in f for op in (Op(WAIT, "dispatch", u, j), Op(COMPUTE, "experts", u, j))]
    w3 += [Op(LAUNCH, "combine", u, j) for u in f]
    w4 = [op for u in b for op in _replay_to_combine(u, below)] if below is not None else []
    w4 += [op for u in b for op in _pre_dispatch_bwd(u, k)]
    for out in outs:
        out.pending = j
    label = f"F L{j} + B L{k} replayed"
    return [Window(f"{label} {i}", tuple(ops)) for i, ops in enumerate((w1, w2, w3, w4), 1)]


def backward_begin(b: Sequence[int], shape, *, replay_top: bool) -> Window:
    """The start of B's backward; with ``replay_top`` the top layer's replay runs around it, its combine in flight."""
    top = len(shape.moe) - 1
    begin = [op for u in b for op in _replay_start(u, top)] if replay_top else []
    begin += [_backward_begin(u, shape) for u in b]
    begin += [op for u in b for op in _replay_to_combine(u, top)] if replay_top else []
    return Window("B begin", tuple(begin))


def replays_ahead(shape) -> bool:
    """Whether every recomputed segment of ``shape`` is one layer (and there is one), so each can be replayed ahead."""
    return bool(shape.segments) and all(stop - first == 1 for first, stop in shape.segments)


def backwards_ahead(b: Sequence[int], shape, delay_wgrad: bool) -> list[Window]:
    """One or two lone backwards, one-layer segments replayed a layer ahead. The first B's contributions come first;
    a delayed attention wgrad goes beside the next layer's combine backward."""
    top = len(shape.moe) - 1
    ahead = {first for first, _ in shape.segments}
    windows, pending = [backward_begin(b, shape, replay_top=top in ahead)], None
    for k in reversed(range(top + 1)):
        below = k - 1 if k - 1 in ahead else None
        ops = [op for u in b for op in (_replay_output(u, k) if k in ahead else []) + _combine_bwd(u, k)]
        ops += _attention_wgrad(b, pending, delay_wgrad)
        if below is not None:
            ops += [op for u in b for op in _replay_start(u, below)]
        ops += [op for u in b for op in _experts_bwd(u, k, shape.moe[k], delay_wgrad)]
        if below is not None:
            ops += [op for u in b for op in _replay_to_combine(u, below)]
        ops += [op for u in b for op in _pre_dispatch_bwd(u, k)]
        windows.append(Window(f"B L{k} replayed" + (" x2" if len(b) == 2 else ""), tuple(ops)))
        pending = k
    ends = _attention_wgrad(b, pending, delay_wgrad) + [_backward_end(u, shape) for u in b]
    return windows + [Window("ends", tuple(ends))]
