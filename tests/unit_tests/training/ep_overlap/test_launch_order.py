"""The host's real launches follow the schedule program: what the ranks issue is what ``program_events.py`` derives.

Forked ranks record the host's order of every compute node, all-to-all launch and wait, split-size exchange and
P2P transfer of one step (``launch_order.py``), for a few option combinations on the reference model and on a
Megatron-Core model, through the engine at PP 1 and PP 2 x VPP 2, and through Megatron-Core's own driver (the hook).
The engine's events must equal those derived from its program; each call of Megatron-Core's driver must issue the
program's step for that call, and the order of the driver's calls (its schedule, not ours) is recorded in
``golden/mcore_driver_calls.txt`` (rewrite it with ``EP_OVERLAP_WRITE_GOLDEN=1`` after a deliberate change). What
every combination's program is: ``test_program_golden.py``.
"""

import os
import re
from pathlib import Path

import pytest

from megatron.bridge.utils.multiprocess import run_local_ranks

from .launch_order import mcore_engine_orders, mcore_hook_orders, reference_orders
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


def _first_difference(where: str, got: list[str], want: list[str]) -> str:
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    have, should = (seq[i] if i < len(seq) else "<end>" for seq in (got, want))
    return f"{where}: event {i} is {have!r}, the program says {should!r}"


def _calls(events: list[str]) -> list[tuple[str, list[str]]]:
    """The driver's calls into the plan: each ``run`` line with the events up to the next one (its hooks apart)."""
    calls = []
    for line in events:
        if line.startswith("run "):
            calls.append((line, []))
        elif not line.startswith("hook "):
            calls[-1][1].append(line)
    return calls


@pytest.mark.parametrize("pp, vpp", [(1, None), (2, 2), (2, None)], ids=["pp1", "pp2-vpp2", "pp2-1f1b"])
def test_each_call_of_megatron_cores_driver_runs_the_programs_step(pp, vpp):
    recorded, layout = {}, f"pp{pp}" if vpp or pp == 1 else f"pp{pp}-1f1b"
    for outcome in run_local_ranks(mcore_hook_orders, 2 * pp, (pp, 3 if pp == 1 else 4, vpp)):
        shapes, numbers = rank_chunks(FREQ[pp], pp, outcome.rank // 2, vpp or 1)
        for combo, events in sorted(outcome.result.items()):
            options = dict(kv.split("=") for kv in combo.split(","))
            for head, got in _calls(events):
                sides = dict((m[1], (0 if m[2] == "None" else int(m[2]), int(m[3])))
                             for m in re.finditer(r"([FB])(None|\d+)m(\d+)", head))  # fmt: skip
                want = driver_call_events(
                    sides.get("F"), sides.get("B"), shapes, numbers, delay_wgrad=options["delay_wgrad"] == "True",
                    window=int(options["attention_wgrad_window"]),
                )  # fmt: skip
                assert got == want, _first_difference(f"{layout} rank {outcome.rank} {combo} {head}", got, want)
            calls = [line for line in events if line.startswith(("run ", "hook "))]
            recorded[f"{layout} rank{outcome.rank} {combo}"] = calls
    _check_calls(layout, recorded)


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
