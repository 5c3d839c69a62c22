"""One loop over a program's ops for its three consumers (the engine's nodes, the planner's simulator and memory
count), and the one place that decides in which order a lane issues them.

Contract:
    * :func:`run_ops` calls each op on a runner: op ``(kind, name)`` of unit ``u`` is the method its :data:`OPS`
      entry names (``OpSpec.method``, e.g. ``launch_dispatch``) of ``runners[u]`` for an op at the chunk's ends, of
      ``runners[u].layers[j]`` for one at layer j. What an op writes (``OpSpec.writes``: ``x`` the unit's
      activation, ``g`` its gradient, ``r`` a replayed activation) is handed to the next op of that unit that reads
      it.
    * The program says what may overlap (its windows), what each op depends on (its unit's earlier ops and its
      lane's, ``Op.lane``) and which ops block the host on any lane (``OpSpec.host_sync``: the dispatcher's
      device-to-host sync of F's split sizes, a pipeline receive). The order a lane issues them in follows from its
      kind, here and nowhere else (:func:`issue_order`):
        - ``IssueOrder.HOST`` (a CPU lane: compute runs on the host thread and blocks it): program order, so every
          transfer is launched before the compute it is to hide behind;
        - ``IssueOrder.DEVICE`` (the CUDA lane: compute, waits and transfers are only queued on streams): the same
          order on each stream (computations and waits in program order, launches in program order, each unit's
          ops in program order), with every host sync issued only once nothing left can be queued without it. In
          the paired layer step that queues B's expert backward before F's split-size sync and dispatch, as
          Megatron-Core's own plan does; the streams get the same work in the same order, so every number is too.
      A runner says its lane's kind as ``issue``; one that says none (the planner's runners, which price a CPU
      host lane) runs in program order.
    * The runners differ, the loop does not: the engine's ``MicrobatchNodes`` (and, overlap off, ``PlainRun``) run
      the model; ``planner/simulate.py`` charges each op a time on one rank's compute and link; ``planner/memory.py``
      holds and lets go of what each node saves for backward. A runner has one method per op it can be given
      (:class:`NoComm` gives those that move nothing for a runner that counts no communication).
    * No torch here.
"""

import heapq
from collections.abc import Iterable, Mapping
from enum import StrEnum

from megatron.bridge.training.ep_overlap.program.ops import OPS, Op


class IssueOrder(StrEnum):
    """How a lane runs what the host issues, and so the order it wants the ops in (see the module docstring)."""

    HOST = "host"  # compute blocks the host: program order
    DEVICE = "device"  # compute is queued asynchronously: host syncs after the work that does not need them


def issue_order(ops: Iterable[Op], order: IssueOrder) -> tuple[Op, ...]:
    """``ops`` (what a lane is given at once: a program step, or one call of Megatron-Core's driver) in the order a
    lane of kind ``order`` issues them.

    On a device lane this is a list schedule: the next op is the first one in program order whose prerequisites
    (the earlier ops of its unit and of its lane, :attr:`Op.lane`) were issued and that is not a host sync; only when
    every op left is a host sync or waits for one is the first ready host sync issued. Without a host sync that is
    program order again.
    """
    ops = tuple(ops)
    if order == IssueOrder.HOST or not any(op.spec.host_sync for op in ops):
        return ops
    # An op depends on the earlier ops of its unit and of its lane, each a total order: the latest earlier op of the
    # unit and of the lane are its only direct prerequisites, the others come before those.
    waiting_for, unblocks = [0] * len(ops), [[] for _ in ops]
    latest: dict[tuple[str, object], int] = {}
    for i, op in enumerate(ops):
        mine = [("unit", op.unit)] + ([("lane", op.lane)] if op.lane is not None else [])
        needs = {latest[key] for key in mine if key in latest}
        for j in needs:
            unblocks[j].append(i)
        waiting_for[i] = len(needs)
        latest.update((key, i) for key in mine)
    work: list[int] = []  # ready ops that queue, by position in program order
    syncs: list[int] = []  # ready host syncs, likewise

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
    """The order the runners' lane issues in (their ``issue``; program order for runners that name none).

    Raises:
        ValueError: When the runners of one call name different orders (they would share no lane).
    """
    orders = {getattr(runner, "issue", IssueOrder.HOST) for runner in runners.values() if runner is not None}
    if len(orders) > 1:
        raise ValueError(f"the runners of one step issue in different orders {sorted(orders)}: one lane runs a step")
    return orders.pop() if orders else IssueOrder.HOST


def run_ops(ops: Iterable[Op], runners: Mapping[int, object], order: IssueOrder | None = None) -> None:
    """Runs ``ops`` on ``runners`` (unit -> the unit's runner, whose ``layers`` run its layer ops), issued in
    ``order`` (default: the runners' lane's, :func:`lane_order`)."""
    values = {}
    for op in issue_order(ops, order or lane_order(runners)):
        target = runners[op.unit] if op.layer is None else runners[op.unit].layers[op.layer]
        spec = OPS[(op.kind, op.name)]
        method = getattr(target, spec.method)
        out = method(values.pop((op.unit, spec.reads))) if spec.reads else method()
        if spec.writes:
            values[(op.unit, spec.writes)] = out


class NoComm:
    """A layer runner's communication ops as nothing: for a runner that counts only what nodes compute and save."""

    def launch_split(self) -> None: ...

    def wait_split(self) -> None: ...

    def launch_dispatch(self) -> None: ...

    def wait_dispatch(self) -> None: ...

    def launch_combine(self) -> None: ...

    def wait_combine(self) -> None: ...

    def launch_combine_bwd(self) -> None: ...

    def wait_combine_bwd(self) -> None: ...

    def launch_dispatch_bwd(self) -> None: ...

    def wait_dispatch_bwd(self) -> None: ...

    def launch_replay_dispatch(self) -> None: ...

    def wait_replay_dispatch(self) -> None: ...

    def launch_replay_combine(self) -> None: ...

    def wait_replay_combine(self) -> None: ...


class NoPipeline:
    """A chunk runner's P2P ops refused: for a runner of a PP = 1 program (the planner's)."""

    def _refuse(self, *args) -> None:
        raise ValueError("a pipeline transfer in the program: the planner prices PP = 1 programs only")

    wait_recv_activation = launch_send_activation = wait_recv_grad = launch_send_grad = _refuse


__all__ = ["IssueOrder", "NoComm", "NoPipeline", "Op", "issue_order", "lane_order", "run_ops"]
