"""The order of issue follows the lane (``program/interpreter.issue_order``), checked on lane stand-ins in-process.

A device lane (CUDA) only queues compute, waits and transfers on its streams; its host blocks only in a host sync (F's
split sizes: the dispatcher's device-to-host sync; a pipeline receive). So on a device lane the host must never sync
while work that does not need the sync could still be queued, and each stream must get the same work in the same
order as in program order (then every number is the same). A host lane (CPU), whose compute blocks the host, issues
program order: today's order, which ``test_program_golden.py`` pins for every option combination.

The stand-in runners below record every op ``run_ops`` gives them and say which lane they are (``issue``), as the
engine's nodes say their lane's. The checks use their own statement of what depends on what (``_needs``), and a few
representative steps are written down as they must be issued.
"""

from dataclasses import replace

import pytest

from ep_overlap_lab.program.steps import program
from megatron.bridge.training.ep_overlap.options import EPOverlapOptions
from megatron.bridge.training.ep_overlap.program.interpreter import IssueOrder, lane_order, run_ops
from megatron.bridge.training.ep_overlap.program.ops import OPS, Op
from megatron.bridge.training.ep_overlap.program.steps import ChunkShape, StepKind, windows_of

from .program_events import rank_chunks

# ---- the stand-ins -----------------------------------------------------------------------------------------------

_OP_OF_METHOD = {spec.method: key for key, spec in OPS.items()}


class _Recorder:
    """Takes any op method of the table and records it as the op it runs (unit, layer)."""

    def __init__(self, log: list, unit: int, layer: int | None):
        self._log, self._unit, self._layer = log, unit, layer

    def __getattr__(self, method: str):
        if method not in _OP_OF_METHOD:  # not an op's method (a lane's ``issue``, say): not had
            raise AttributeError(method)
        kind, name = _OP_OF_METHOD[method]

        def record(*value):
            self._log.append(Op(kind, name, self._unit, self._layer))
            return f"{name} of u{self._unit}"

        return record


class _UnitOnALane(_Recorder):
    """A unit's runner on a lane stand-in: ``issue`` says which lane (None: names none, as the planner's runners)."""

    def __init__(self, log: list, unit: int, layers: int, issue: IssueOrder | None):
        super().__init__(log, unit, None)
        self.layers = [_Recorder(log, unit, j) for j in range(layers)]
        if issue is not None:
            self.issue = issue


def issued(step, issue: IssueOrder | None) -> tuple[Op, ...]:
    """The ops of ``step`` as ``run_ops`` issues them to runners on a lane of kind ``issue``."""
    log: list[Op] = []
    layers = max((op.layer for op in step.ops if op.layer is not None), default=-1) + 1
    run_ops(step.ops, {m.unit: _UnitOnALane(log, m.unit, layers, issue) for m in step.units})
    return tuple(log)


# ---- the programs ----------------------------------------------------------------------------------------------

PP1 = [1, 0, 1]  # MoE, dense, MoE
SEGMENTS = {"uniform 1": ((0, 1), (1, 2), (2, 3)), "uniform 2": ((0, 2), (2, 3)), "block 1": ((0, 1),)}


def _programs() -> dict[str, list]:
    """A few program shapes: PP 1 with each way of pairing the ends and delayed wgrad in either window, forward-only
    steps, PP 2 x VPP 2 (both ranks), and full recompute (each kind of segment)."""
    out = {}
    pp1 = {
        "overlap": {},
        "delayed w1": {"delay_wgrad": True},
        "delayed w2": {"delay_wgrad": True, "attention_wgrad_window": 2},
        "edges delayed w2": {"delay_wgrad": True, "attention_wgrad_window": 2, "edge_pairing": True},
        "chunks delayed w1": {"delay_wgrad": True, "moe_ep_overlap_chunks": 2},
    }
    shapes, _ = rank_chunks(PP1, 1, 0)
    for name, fields in pp1.items():
        for n in (1, 3):
            out[f"pp1 N={n} {name}"] = list(program(EPOverlapOptions(**fields), shapes, n))
    for name, fields in (("edges", {"edge_pairing": True}), ("chunks", {"moe_ep_overlap_chunks": 2})):
        out[f"pp1 N=3 forward-only {name}"] = list(program(EPOverlapOptions(**fields), shapes, 3, forward_only=True))
    for rank in range(2):
        shapes, _ = rank_chunks([1, 0, 1, 1], 2, rank)
        for name, fields in (("overlap", {}), ("delayed w2", {"delay_wgrad": True, "attention_wgrad_window": 2})):
            steps = program(EPOverlapOptions(**fields), shapes, 5, pipeline_size=2, rank=rank)
            out[f"pp2 vpp2 rank {rank} N=5 {name}"] = list(steps)
    for name, segments in SEGMENTS.items():
        shape = ChunkShape(True, True, (True, False, True), segments)
        for fields in ({}, {"delay_wgrad": True}, {"delay_wgrad": True, "edge_pairing": True}):
            label = " ".join(f"{k}" for k in fields) or "overlap"
            out[f"full recompute {name} N=3 {label}"] = list(program(EPOverlapOptions(**fields), [shape], 3))
    return out


PROGRAMS = _programs()


def test_the_programs_cover_every_step_kind_and_host_sync():
    kinds = {step.kind for steps in PROGRAMS.values() for step in steps}
    assert kinds == set(StepKind)
    syncs = {(op.kind, op.name) for steps in PROGRAMS.values() for step in steps for op in step.ops if _sync(op)}
    assert syncs == SYNCS


# ---- what depends on what, stated here (not read from the code under test) --------------------------------------

SYNCS = {("wait", "split"), ("wait", "recv_activation"), ("wait", "recv_grad")}  # the host blocks on any lane


def _sync(op: Op) -> bool:
    return (op.kind, op.name) in SYNCS


def _stream(op: Op) -> str | None:
    """What a device lane queues the op on: launches on the comm stream, computations and waits for transfers on the
    compute stream; a host sync on neither."""
    return None if _sync(op) else "comm" if op.kind == "launch" else "compute"


def _needs(ops: tuple[Op, ...]) -> list[int]:
    """For each op (in program order), the host syncs it needs, directly or through others, as a bit mask of
    positions: it needs every earlier op of its unit and of its stream."""
    needs = []
    for i, op in enumerate(ops):
        mask = 0
        for j, earlier in enumerate(ops[:i]):
            if earlier.unit == op.unit or (_stream(op) is not None and _stream(op) == _stream(earlier)):
                mask |= needs[j] | ((1 << j) if _sync(earlier) else 0)
        needs.append(mask)
    return needs


def device_order_problems(step, got: tuple[Op, ...]) -> list[str]:
    """What is wrong with ``got`` as a device lane's order of ``step``: every op once, each stream's and each unit's
    ops in program order, and no host sync while an op that needs no sync still to come could be queued."""
    ops = tuple(step.ops)
    if sorted(map(str, got)) != sorted(map(str, ops)):
        return ["not the step's ops"]
    problems = []
    for what, key in (("stream", _stream), ("unit", lambda op: op.unit)):
        for value in {key(op) for op in ops} - {None}:
            if [op for op in got if key(op) == value] != [op for op in ops if key(op) == value]:
                problems.append(f"{what} {value} is not in program order")
    window = {op: w.label for w in step.windows for op in w.ops}
    needs = dict(zip(ops, _needs(ops)))
    position = {op: i for i, op in enumerate(got)}
    for p, sync in enumerate(got):
        if not _sync(sync):
            continue
        for later in got[p + 1 :]:
            pending = [op for i, op in enumerate(ops) if needs[later] >> i & 1 and position[op] >= p]
            if not _sync(later) and not pending:
                problems.append(f"{window[sync]}: host sync {sync} before {later} ({window[later]}), which needs none")
    return problems


# ---- a device lane -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_on_a_device_lane_no_host_sync_comes_before_work_that_does_not_need_it(name):
    for i, step in enumerate(PROGRAMS[name]):
        problems = device_order_problems(step, issued(step, IssueOrder.DEVICE))
        assert not problems, f"{name} step {i} ({step.kind}): " + "; ".join(problems[:3])


def test_program_order_forced_on_a_device_lane_fails_the_check():
    """The check has teeth: program order (today's, a host lane's) syncs on F's split sizes in window 2 of the paired
    layer step before B's expert backward, which does not need them, in every paired step that has such a sync."""
    step = PROGRAMS["pp1 N=3 delayed w2"][1]
    assert (
        "F L0 + B L2 2: host sync wait split u1 L0 before wait combine_bwd u0 L2 (F L0 + B L2 2), which needs none"
        in device_order_problems(step, tuple(step.ops))
    )
    checked = 0
    for name, steps in PROGRAMS.items():
        for i, step in enumerate(steps):
            if step.kind == StepKind.PAIRED and any(op.name == "split" and op.kind == "wait" for op in step.ops):
                assert device_order_problems(step, tuple(step.ops)), f"{name} step {i}"
                checked += 1
    assert checked > 20


# ---- a host lane -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("issue", [IssueOrder.HOST, None], ids=["host lane", "no lane named"])
def test_a_host_lane_issues_program_order(issue):
    for name, steps in PROGRAMS.items():
        for i, step in enumerate(steps):
            assert issued(step, issue) == tuple(step.ops), f"{name} step {i}"


# ---- written down: the paired layer step, chunked halves as F, and a replayed step (the device order reaches into
# the next window there)

# PP 1, N = 3, delayed wgrad, attention wgrad in window 2: the first paired step (F = u1, B = u0), its first layer
# step (F's layer 0, MoE, with B's layer 2, MoE), windows 1 to 4.
PAIRED_LAYER_STEP = {
    IssueOrder.HOST: """
        compute combine_bwd u0 L2
        launch combine_bwd u0 L2
        compute embedding u1
        compute pre_dispatch u1 L0
        launch split u1 L0
        wait split u1 L0
        launch dispatch u1 L0
        wait combine_bwd u0 L2
        compute experts_bwd u0 L2
        launch dispatch_bwd u0 L2
        wgrad experts u0 L2
        wait dispatch u1 L0
        compute experts u1 L0
        launch combine u1 L0
        wait dispatch_bwd u0 L2
        compute pre_dispatch_bwd u0 L2
    """,
    IssueOrder.DEVICE: """
        compute combine_bwd u0 L2
        launch combine_bwd u0 L2
        compute embedding u1
        compute pre_dispatch u1 L0
        launch split u1 L0
        wait combine_bwd u0 L2
        compute experts_bwd u0 L2
        wait split u1 L0
        launch dispatch u1 L0
        launch dispatch_bwd u0 L2
        wgrad experts u0 L2
        wait dispatch u1 L0
        compute experts u1 L0
        launch combine u1 L0
        wait dispatch_bwd u0 L2
        compute pre_dispatch_bwd u0 L2
    """,
}
# The same step's last layer step (F's layer 2 with B's layer 0), window 2: B's previous attention wgrad goes here.
WINDOW_2_WITH_THE_WGRAD = {
    IssueOrder.HOST: """
        wait split u1 L2
        launch dispatch u1 L2
        wgrad attention u0 L1
        wait combine_bwd u0 L0
        compute experts_bwd u0 L0
    """,
    IssueOrder.DEVICE: """
        wgrad attention u0 L1
        wait combine_bwd u0 L0
        compute experts_bwd u0 L0
        wait split u1 L2
        launch dispatch u1 L2
    """,
}
# Chunks, N = 3, delayed wgrad: the last microbatch's halves (u3, u4) forward beside B = u2: each half's sync comes
# after B's expert backward, and right before its own dispatch.
CHUNKED_HALVES = """
    wait combine_bwd u2 L2
    compute experts_bwd u2 L2
    wait split u3 L0
    launch dispatch u3 L0
    wait split u4 L0
    launch dispatch u4 L0
    launch dispatch_bwd u2 L2
"""
# Full recompute, one-layer segments, delayed wgrad: the last replayed layer step (F's layer 2 with B's layer 0).
# The program puts B's expert backward in window 3; nothing in it needs F's split sizes, so a device lane queues
# it before the sync (the order of Megatron-Core's plan).
REPLAYED_LAST_LAYER = """
    launch combine_bwd u0 L0
    wgrad attention u0 L1
    wait combine_bwd u0 L0
    compute experts_bwd u0 L0
    wait split u1 L2
    launch dispatch u1 L2
    launch dispatch_bwd u0 L0
"""


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().splitlines()]


def _run_from(ops: tuple[Op, ...], expected: list[str]) -> list[str]:
    """The ops issued from the first one ``expected`` names, as many as it has."""
    names = [str(op) for op in ops]
    start = names.index(expected[0])
    return names[start : start + len(expected)]


@pytest.mark.parametrize("issue", [IssueOrder.HOST, IssueOrder.DEVICE])
def test_the_paired_layer_step_as_each_lane_issues_it(issue):
    step = PROGRAMS["pp1 N=3 delayed w2"][1]
    assert step.kind == StepKind.PAIRED
    got = issued(step, issue)
    for written in (PAIRED_LAYER_STEP[issue], WINDOW_2_WITH_THE_WGRAD[issue]):
        assert _run_from(got, _lines(written)) == _lines(written)


@pytest.mark.parametrize(
    "name, index, written",
    [("pp1 N=3 chunks delayed w1", 2, CHUNKED_HALVES), ("full recompute uniform 1 N=3 delay_wgrad", 1,
                                                          REPLAYED_LAST_LAYER)],
    ids=["chunked halves", "full recompute"],
)  # fmt: skip
def test_a_device_lane_queues_what_needs_no_sync_before_the_sync(name, index, written):
    step = PROGRAMS[name][index]
    assert _run_from(issued(step, IssueOrder.DEVICE), _lines(written)) == _lines(written)
    assert _run_from(issued(step, IssueOrder.HOST), _lines(written)) != _lines(written)


# ---- the lanes of one call, and the window the program needs -----------------------------------------------------


def test_runners_of_one_step_on_different_lanes_are_refused():
    log: list[Op] = []
    runners = {0: _UnitOnALane(log, 0, 1, IssueOrder.HOST), 1: _UnitOnALane(log, 1, 1, IssueOrder.DEVICE)}
    with pytest.raises(ValueError, match="issue in different orders"):
        lane_order(runners)
    assert lane_order({0: None, 1: runners[1]}) == IssueOrder.DEVICE  # a driver call without a forward
    assert lane_order({}) == IssueOrder.HOST


def test_a_step_that_defers_its_wgrad_needs_a_resolved_window():
    shapes, _ = rank_chunks(PP1, 1, 0)
    auto = EPOverlapOptions(delay_wgrad=True, attention_wgrad_window=None)
    with pytest.raises(ValueError, match=r"attention_wgrad_window=None: the program puts each delayed attention"):
        list(program(auto, shapes, 3))
    with pytest.raises(ValueError, match=r"attention_wgrad_window=3"):
        windows_of(StepKind.PAIRED, [1], [0], shapes[0], shapes[0], delay_wgrad=True, window=3)
    # What the settings resolved goes in as values (the engine's settings; the planner passes the options alone).
    resolved = [str(w) for step in program(auto, shapes, 3, window=2) for w in step.windows]
    given = EPOverlapOptions(delay_wgrad=True, attention_wgrad_window=2)
    assert resolved == [str(w) for step in program(given, shapes, 3) for w in step.windows]
    with pytest.raises(ValueError, match=r"attention_wgrad_window=None"):
        list(program(EPOverlapOptions(attention_wgrad_window=None), shapes, 3, delay_wgrad=True))
    # Where nothing is placed the window is not read: forward-only steps, the plain path, nothing delayed.
    assert list(program(auto, shapes, 3, forward_only=True))
    assert list(program(replace(auto, overlap=False), shapes, 3))
    assert list(program(replace(auto, delay_wgrad=False), shapes, 3))
