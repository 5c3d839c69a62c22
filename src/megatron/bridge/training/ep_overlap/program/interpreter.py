"""One loop over a program's ops for all its consumers (:func:`run_ops`: what an op writes goes to the next op of
its unit that reads it), and the one place that decides a lane's issue order (:func:`issue_order`). A device lane
keeps each unit's and lane's order and issues a host sync only once nothing else can be queued, so every number stays
the same. No torch here."""

import heapq
from collections.abc import Iterable, Mapping
from enum import StrEnum

from megatron.bridge.training.ep_overlap.program.ops import Op


class IssueOrder(StrEnum):
    """How a lane runs what the host issues: HOST (compute blocks it; program order) or DEVICE (work is queued)."""

    HOST = "host"
    DEVICE = "device"


def issue_order(ops: Iterable[Op], order: IssueOrder) -> tuple[Op, ...]:
    """``ops`` in the order a lane of kind ``order`` wants; on a device lane, the first ready op (its unit's and lane's
    earlier ops issued) in program order, a ready host sync only when no other op is ready."""
    ops = tuple(ops)
    if order == IssueOrder.HOST or not any(op.spec.host_sync for op in ops):
        return ops
    # Unit and lane are each a total order: an op's direct prerequisites are the latest earlier op of each.
    waiting_for, unblocks = [0] * len(ops), [[] for _ in ops]
    latest: dict[tuple[str, object], int] = {}
    for i, op in enumerate(ops):
        mine = [("unit", op.unit)] + ([("lane", op.lane)] if op.lane is not None else [])
        needs = {latest[key] for key in mine if key in latest}
        for j in needs:
            unblocks[j].append(i)
        waiting_for[i] = len(needs)
        latest.update((key, i) for key in mine)
    work: list[int] = []
    syncs: list[int] = []

    def ready(i: int) -> None:
        heapq.heappush(syncs if ops[i].spec.host_sync else work, i)

    for i, count in enumerate(waiting_for):
        if count == 0:
            ready(i)
    issued = []
    while work or syncs:
        i = heapq.heappop(work if work else syncs)
        issued.append(ops[i])
        for k in unblocks[i]:
            waiting_for[k] -= 1
            if waiting_for[k] == 0:
                ready(k)
    return tuple(issued)


def lane_order(runners: Mapping[int, object]) -> IssueOrder:
    """The runners' common ``issue`` order (HOST for runners naming none); a ValueError if they differ."""
    orders = {getattr(runner, "issue", IssueOrder.HOST) for runner in runners.values() if runner is not None}
    if len(orders) > 1:
        raise ValueError(f"the runners of one step issue in different orders {sorted(orders)}: one lane runs a step")
    return orders.pop() if orders else IssueOrder.HOST


def run_ops(ops: Iterable[Op], runners: Mapping[int, object], order: IssueOrder | None = None) -> None:
    """Runs ``ops`` on ``runners`` (unit -> runner; its ``layers`` run layer ops), by default in their lane's order."""
    values = {}
    for unit, layer, method, reads, writes in _compiled(tuple(ops), order or lane_order(runners)):
        target = runners[unit] if layer is None else runners[unit].layers[layer]
        out = getattr(target, method)(values.pop((unit, reads))) if reads else getattr(target, method)()
        if writes:
            values[(unit, writes)] = out


def _compiled(ops: tuple[Op, ...], order: IssueOrder) -> tuple[tuple, ...]:
    """``ops`` issued in ``order`` as (unit, layer, method, reads, writes), once per distinct step."""
    if (ops, order) not in _COMPILED:
        if len(_COMPILED) >= 256:  # the lab's planner runs many distinct steps
            _COMPILED.clear()
        issued = ((op, op.spec) for op in issue_order(ops, order))
        _COMPILED[(ops, order)] = tuple((op.unit, op.layer, s.method, s.reads, s.writes) for op, s in issued)
    return _COMPILED[(ops, order)]


_COMPILED: dict[tuple[tuple[Op, ...], IssueOrder], tuple[tuple, ...]] = {}


__all__ = ["IssueOrder", "Op", "issue_order", "lane_order", "run_ops"]
