"""The host's real launches follow the schedule program, in the order its lane issues them; a few representative
steps are written down here, so a changed schedule fails here too.

Forked ranks record the host's order of every compute node, all-to-all launch and wait, split-size exchange and
P2P transfer of one step (``launch_order.py``), for a few option combinations on the reference model and on a
Megatron-Core model, through the engine at PP 1 and PP 2 x VPP 2, and through Megatron-Core's own driver (the hook).

* The engine's events must equal those derived from its program (``program_events.py``: the engine executes its
  program, whatever it is), and one representative step of each group must be the one written down below (the
  program is the schedule this project means: a change to it fails here, not only in ``test_program_golden.py``).
* Each call of Megatron-Core's driver must issue the program's step for that call (derived, and one call written
  down); the order of the driver's calls (its schedule, not ours) is in ``golden/mcore_driver_calls.txt`` (rewrite
  it with ``EP_OVERLAP_WRITE_GOLDEN=1`` after a deliberate change).
* On the device-lane stand-in (a CPU lane that issues as the CUDA lane does, ``launch_order.as_a_device_lane``) the
  engine and Megatron-Core's driver both queue B's expert backward before F's split-size sync and dispatch (written
  down), issue exactly the program's device order (derived), and every loss and gradient is bitwise that of the host
  order (the engine) or of Megatron-Core's plain path (its driver).
"""

import os
import re
from pathlib import Path

import pytest

from megatron.bridge.training.ep_overlap.program.interpreter import IssueOrder

from .bitwise import assert_steps_bitwise
from .launch_order import (
    mcore_driver_on_a_device_lane,
    mcore_engine_orders,
    mcore_hook_orders,
    reference_on_both_lanes,
    reference_orders,
)
from .local_ranks import run_local_ranks
from .mcore_models import McoreCase
from .program_events import driver_call_events, engine_step_events, key, rank_chunks

CALLS = Path(__file__).parent / "golden" / "mcore_driver_calls.txt"
FREQ = {1: [1, 0, 1], 2: [1, 0, 1, 1]}


def _combos(*options: dict) -> list[dict]:
    return [{"launch_off_host": None, "forward_only": False} | o for o in options]


# A few combinations each: plain, overlap on the helper thread, delayed wgrad in both windows with each way of
# pairing the ends, forward-only, and the auto window's first (plain) step.
PP1 = _combos(
    {"overlap": False},
    {"overlap": True, "launch_off_host": True},
    {
        "overlap": True,
        "delay_wgrad": True,
        "attention_wgrad_window": 2,
        "edge_pairing": True,
        "launch_off_host": False,
    },
    {"overlap": True, "delay_wgrad": True, "attention_wgrad_window": 1, "moe_ep_overlap_chunks": 2},
    {"overlap": True, "edge_pairing": True, "forward_only": True},
    {"overlap": True, "delay_wgrad": True, "attention_wgrad_window": None},
)
PP2 = _combos(
    {"overlap": False},
    {"overlap": True, "delay_wgrad": True, "attention_wgrad_window": 2},
    {"overlap": True, "forward_only": True},
)
GROUPS = {  # name: (worker, ranks, pipeline size, microbatch counts, combinations, Megatron-Core model)
    "reference/pp1": (reference_orders, 2, 1, (1, 3), PP1, False),
    "reference/pp2-vpp2": (reference_orders, 4, 2, (5,), PP2, False),
    "mcore-engine/pp1": (mcore_engine_orders, 2, 1, (3,), [PP1[0], PP1[2]], True),
    "mcore-engine/pp2-vpp2": (mcore_engine_orders, 4, 2, (4,), [PP2[1]], True),
}


# ---- written down: what the host issues in representative steps (reviewed against "The paired layer step" in
# docs/training/ep-overlap-schedule.md; events as launch_order.py records them: m<unit>, L<global layer>, L-1 the
# embedding)

# PP 1, N = 3, delayed wgrad, attention wgrad in window 2, edge pairing: the paired step F(2) + B(0), from the head's
# backward through its first layer step (F's layer 0, MoE, with B's layer 2, MoE), windows 1 to 4.
REFERENCE_PAIRED_LAYER_STEP = """
    compute head_bwd L3 m0 paired
    compute combine_bwd L2 m0 paired
    launch combine_bwd L2 m0 paired
    compute embedding L-1 m2 paired
    compute pre_dispatch L0 m2 paired
    record split_exchange L0 m2 paired
    launch dispatch L0 m2 paired
    wait combine_bwd L2 m0
    compute experts_bwd L2 m0 paired
    launch dispatch_bwd L2 m0 paired
    compute expert_wgrad L2 m0 paired
    wait dispatch L0 m2
    compute experts L0 m2 paired
    launch combine L0 m2 paired
    wait dispatch_bwd L2 m0
    compute pre_dispatch_bwd L2 m0 paired
    compute combine_bwd L1 m0 paired
    wait combine L0 m2
"""
# The same on a Megatron-Core model: its dispatch moves tokens and probabilities (one launch, two waits each way).
MCORE_PAIRED_LAYER_STEP = """
    compute head_bwd L3 m0 paired
    compute combine_bwd L2 m0 paired
    launch combine_bwd L2 m0 paired
    compute embedding L-1 m2 paired
    compute pre_dispatch L0 m2 paired
    record split_exchange L0 m2 paired
    launch dispatch L0 m2 paired
    wait combine_bwd L2 m0
    compute experts_bwd L2 m0 paired
    launch dispatch_bwd L2 m0 paired
    launch dispatch_bwd L2 m0 paired
    compute expert_wgrad L2 m0 paired
    wait dispatch L0 m2
    wait dispatch L0 m2
    compute experts L0 m2 paired
    launch combine L0 m2 paired
    wait dispatch_bwd L2 m0
    wait dispatch_bwd L2 m0
    compute pre_dispatch_bwd L2 m0 paired
"""
# PP 2 x VPP 2, N = 5, delayed wgrad in window 2, pipeline rank 0: its first paired step, F(4) on chunk 0 with B(0)
# on chunk 2 (one MoE layer each beside the other): B's output gradient arrives, F's activation goes out after the
# layers, then B's input gradient, then B's deferred attention wgrad beside them.
PIPELINED_PAIRED_STEP = """
    p2p take Bm0c2r1
    wait p2p Bm0c2r1
    compute combine_bwd L2 m0 paired
    launch combine_bwd L2 m0 paired
    compute embedding L-1 m4 paired
    compute pre_dispatch L0 m4 paired
    record split_exchange L0 m4 paired
    launch dispatch L0 m4 paired
    wait combine_bwd L2 m0
    compute experts_bwd L2 m0 paired
    launch dispatch_bwd L2 m0 paired
    compute expert_wgrad L2 m0 paired
    wait dispatch L0 m4
    compute experts L0 m4 paired
    launch combine L0 m4 paired
    wait dispatch_bwd L2 m0
    compute pre_dispatch_bwd L2 m0 paired
    wait combine L0 m4
    compute combine L0 m4 paired
    p2p send Fm4c1r1
    p2p send Bm0c1r1
    compute attention_wgrad L2 m0 paired
"""
# group: (microbatches, combination, pipeline rank, the events written down)
WRITTEN = {
    "reference/pp1": (3, PP1[2], 0, REFERENCE_PAIRED_LAYER_STEP),
    "reference/pp2-vpp2": (5, PP2[1], 0, PIPELINED_PAIRED_STEP),
    "mcore-engine/pp1": (3, PP1[2], 0, MCORE_PAIRED_LAYER_STEP),
}


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().splitlines()]


def _run_from(events: list[str], written: list[str]) -> list[str]:
    """The recorded events from the first one ``written`` names, as many as it has."""
    assert written[0] in events, f"{written[0]!r} was not recorded"
    start = events.index(written[0])
    return events[start : start + len(written)]


@pytest.mark.lab
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_the_engines_launches_are_its_programs(group):
    worker, ranks, pp, counts, combos, mcore = GROUPS[group]
    for outcome in run_local_ranks(worker, ranks, (pp, counts, combos)):
        assert sorted(outcome.result) == sorted(f"N={n},{key(o)}" for n in counts for o in combos)
        for n in counts:
            for options in combos:
                events = outcome.result[f"N={n},{key(options)}"]
                expected = engine_step_events(
                    options, FREQ[pp], n, pipeline_size=pp, pipeline_rank=outcome.rank // 2,
                    dispatched=2 if mcore else 1, plain_records=not mcore,
                )  # fmt: skip
                assert events == expected, _first_difference(
                    f"{group} rank {outcome.rank} N={n} {options}", events, expected
                )
                assert events or (mcore and not options["overlap"] and pp == 1)  # something was recorded
        if group in WRITTEN:
            n, options, pipeline_rank, written = WRITTEN[group]
            if outcome.rank // 2 == pipeline_rank:
                events = outcome.result[f"N={n},{key(options)}"]
                got = _run_from(events, _lines(written))
                assert got == _lines(written), _first_difference(
                    f"{group} rank {outcome.rank}", got, _lines(written), "written down"
                )


def _first_difference(where: str, got: list[str], want: list[str], source: str = "the program says") -> str:
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    have, should = (seq[i] if i < len(seq) else "<end>" for seq in (got, want))
    return f"{where}: event {i} is {have!r}, {source} {should!r}"


def _calls(events: list[str]) -> list[tuple[str, list[str]]]:
    """The driver's calls into the plan: each ``run`` line with the events up to the next one (its hooks apart)."""
    calls = []
    for line in events:
        if line.startswith("run "):
            calls.append((line, []))
        elif not line.startswith("hook "):
            calls[-1][1].append(line)
    return calls


# Megatron-Core's driver at PP 1, delayed wgrad in window 2: its call F(1) + B(0), the first layer step (written down).
DRIVER_CALL = "N=3,delay_wgrad=True,attention_wgrad_window=2,overlap_p2p_comm=False", "run FNonem1 BNonem0"
DRIVER_PAIRED_LAYER_STEP = """
    compute head_bwd L3 m0 paired
    compute combine_bwd L2 m0 paired
    launch combine_bwd L2 m0 paired
    compute embedding L-1 m1 paired
    compute pre_dispatch L0 m1 paired
    record split_exchange L0 m1 paired
    launch dispatch L0 m1 paired
    wait combine_bwd L2 m0
    compute experts_bwd L2 m0 paired
    launch dispatch_bwd L2 m0 paired
    launch dispatch_bwd L2 m0 paired
    compute expert_wgrad L2 m0 paired
    wait dispatch L0 m1
    wait dispatch L0 m1
    compute experts L0 m1 paired
    launch combine L0 m1 paired
    wait dispatch_bwd L2 m0
    wait dispatch_bwd L2 m0
    compute pre_dispatch_bwd L2 m0 paired
"""
# The same call on the device-lane stand-in, window 2: F's dispatch (after its split-size sync, which records nothing)
# goes out after B's expert backward is queued.
DRIVER_WINDOW_2_ON_A_DEVICE_LANE = """
    record split_exchange L0 m1 paired
    wait combine_bwd L2 m0
    compute experts_bwd L2 m0 paired
    launch dispatch L0 m1 paired
    launch dispatch_bwd L2 m0 paired
"""


def _driver_calls(outcome, pp: int, vpp: int | None, order: IssueOrder) -> dict[str, list[str]]:
    """Checks each recorded call of Megatron-Core's driver against the program's step for it, issued in ``order``;
    returns each combination's events."""
    layout = f"pp{pp}" if vpp or pp == 1 else f"pp{pp}-1f1b"
    shapes, numbers = rank_chunks(FREQ[pp], pp, outcome.rank // 2, vpp or 1)
    for combo, events in sorted(outcome.result.items()):
        options = dict(kv.split("=") for kv in combo.split(","))
        for head, got in _calls(events):
            sides = dict((m[1], (0 if m[2] == "None" else int(m[2]), int(m[3])))
                         for m in re.finditer(r"([FB])(None|\d+)m(\d+)", head))  # fmt: skip
            want = driver_call_events(
                sides.get("F"), sides.get("B"), shapes, numbers, delay_wgrad=options["delay_wgrad"] == "True",
                window=int(options["attention_wgrad_window"]), order=order,
            )  # fmt: skip
            assert got == want, _first_difference(f"{layout} rank {outcome.rank} {combo} {head}", got, want)
    return outcome.result


def _call(events: list[str], head: str) -> list[str]:
    return next(got for line, got in _calls(events) if line == head)


@pytest.mark.parametrize("pp, vpp", [(1, None), (2, 2), (2, None)], ids=["pp1", "pp2-vpp2", "pp2-1f1b"])
def test_each_call_of_megatron_cores_driver_runs_the_programs_step(pp, vpp):
    recorded, layout = {}, f"pp{pp}" if vpp or pp == 1 else f"pp{pp}-1f1b"
    for outcome in run_local_ranks(mcore_hook_orders, 2 * pp, (pp, 3 if pp == 1 else 4, vpp)):
        for combo, events in _driver_calls(outcome, pp, vpp, IssueOrder.HOST).items():
            calls = [line for line in events if line.startswith(("run ", "hook "))]
            recorded[f"{layout} rank{outcome.rank} {combo}"] = calls
        if pp == 1:
            combo, head = DRIVER_CALL
            got = _call(outcome.result[combo], head)[: len(_lines(DRIVER_PAIRED_LAYER_STEP))]
            assert got == _lines(DRIVER_PAIRED_LAYER_STEP), _first_difference(
                head, got, _lines(DRIVER_PAIRED_LAYER_STEP)
            )
    _check_calls(layout, recorded)


# ---- the device-lane stand-in ------------------------------------------------------------------------------------

DEVICE = _combos(
    {"overlap": True, "delay_wgrad": True, "attention_wgrad_window": 2, "launch_off_host": False},
    {"overlap": True, "delay_wgrad": True, "attention_wgrad_window": 1, "moe_ep_overlap_chunks": 2},
    {"overlap": True, "edge_pairing": True, "forward_only": True},
    {"overlap": True, "delay_wgrad": True, "attention_wgrad_window": 1, "recompute": ("uniform", 1)},
)
# Written down: where each combination's device order moves F's dispatch (N = 3, the reference model at PP 1).
DEVICE_WRITTEN = {
    # the paired step F(1) + B(0), window 2 of its first layer step
    0: """
        record split_exchange L0 m1 paired
        wait combine_bwd L2 m0
        compute experts_bwd L2 m0 paired
        launch dispatch L0 m1 paired
        launch dispatch_bwd L2 m0 paired
    """,
    # the last microbatch's halves (units 3 and 4) beside B(1) (unit 2): both halves' dispatches after B's expert
    # backward, each right after its own split-size sync
    1: """
        record split_exchange L0 m4 paired
        wait combine_bwd L2 m2
        compute experts_bwd L2 m2 paired
        launch dispatch L0 m3 paired
        launch dispatch L0 m4 paired
        launch dispatch_bwd L2 m2 paired
    """,
    # one-layer segments: the last replayed layer step of F(1) + B(0); B's expert backward, which the program puts in
    # window 3, is queued before F's split-size sync and dispatch (as Megatron-Core's plan orders the two)
    3: """
        compute attention_wgrad L1 m0 paired
        wait combine_bwd L0 m0
        compute experts_bwd L0 m0 paired
        launch dispatch L2 m1 paired
        launch dispatch_bwd L0 m0 paired
    """,
}


@pytest.mark.lab
def test_on_a_device_lane_the_engine_queues_b_expert_backward_before_f_split_sync():
    for outcome in run_local_ranks(reference_on_both_lanes, 2, (3, DEVICE)):
        for i, options in enumerate(DEVICE):
            method = options.get("recompute", (None,))[0]
            run = outcome.result[key({k: v for k, v in options.items() if k != "recompute"}
                                     | ({"recompute": method} if method else {}))]  # fmt: skip
            where = f"rank {outcome.rank} {options}"
            assert run["bitwise"], f"{where}: a loss or gradient differs from the host order's"
            assert run["grads"] or options["forward_only"], f"{where}: no gradient to compare"
            assert run["device"] != run["host"], f"{where}: the device lane issued the host order"
            if not method:  # program_events does not derive a replay's events
                for lane, order in (("host", IssueOrder.HOST), ("device", IssueOrder.DEVICE)):
                    want = engine_step_events(options, FREQ[1], 3, order=order)
                    assert run[lane] == want, _first_difference(f"{where} {lane}", run[lane], want)
            if i in DEVICE_WRITTEN:
                written = _lines(DEVICE_WRITTEN[i])
                got = _run_from(run["device"], written)
                assert got == written, _first_difference(where, got, written, "written down")
                assert _run_from(run["host"], written) != written


def test_on_a_device_lane_megatron_cores_driver_queues_b_expert_backward_before_f_split_sync():
    for outcome in run_local_ranks(mcore_hook_orders, 2, (1, 3, None, True)):
        events = _driver_calls(outcome, 1, None, IssueOrder.DEVICE)
        combo, head = DRIVER_CALL
        written = _lines(DRIVER_WINDOW_2_ON_A_DEVICE_LANE)
        got = _run_from(_call(events[combo], head), written)
        assert got == written, _first_difference(head, got, written, "written down")


@pytest.mark.parametrize(
    "case", [McoreCase(microbatches=3), McoreCase(microbatches=3, full_recompute=("uniform", 1))],
    ids=["ep2-fp32-top2", "ep2-fp32-full-uniform1"],
)  # fmt: skip
def test_on_a_device_lane_megatron_cores_driver_stays_bitwise_equal_to_its_plain_path(case):
    for outcome in run_local_ranks(mcore_driver_on_a_device_lane, case.world, (case,)):
        assert_steps_bitwise(outcome.result["plain"], outcome.result["overlap"], case.steps, outcome.rank)


def _check_calls(layout: str, recorded: dict[str, list[str]]) -> None:
    """The driver's order of calls and hooks, against golden/mcore_driver_calls.txt (this layout's part)."""
    sections = _read_calls()
    mine = {name: calls for name, calls in sections.items() if name.startswith(f"{layout} ")}
    if os.environ.get("EP_OVERLAP_WRITE_GOLDEN") == "1":
        others = {name: calls for name, calls in sections.items() if not name.startswith(f"{layout} ")}
        merged = others | recorded
        CALLS.write_text("".join(f"## {name}\n" + "".join(f"{c}\n" for c in merged[name]) for name in sorted(merged)))
        return
    assert sorted(recorded) == sorted(mine), "the recorded combinations or ranks differ"
    for name, calls in recorded.items():
        assert calls == mine[name], _first_difference(name, calls, mine[name])


def _read_calls() -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    if CALLS.exists():
        for line in CALLS.read_text().splitlines():
            if line.startswith("## "):
                sections[line[3:]] = []
            elif line:
                sections[next(reversed(sections))].append(line)
    return sections
