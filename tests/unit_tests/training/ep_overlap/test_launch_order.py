"""The schedule's fingerprint: the host's order of every compute node, all-to-all launch and wait, split-size
exchange and P2P transfer, for every option combination the rules allow, on the reference model and on a
Megatron-Core model, through the engine and through Megatron-Core's own driver, at PP 1 and PP 2 x VPP 2.

The golden file was recorded before the schedule became one program (``golden/launch_order.json``); any change to
the order a step issues its work in fails here, naming the first event that differs. After a deliberate change,
rewrite it with ``EP_OVERLAP_WRITE_GOLDEN=1 pytest tests/unit_tests/training/ep_overlap/test_launch_order.py``
and say why in the commit.
"""

import hashlib
import json
import os
from pathlib import Path

import pytest

from megatron.bridge.utils.multiprocess import run_local_ranks

from .launch_order import GROUPS

GOLDEN = Path(__file__).parent / "golden" / "launch_order.json"


def _digest(events: list[str]) -> str:
    return hashlib.sha256("\n".join(events).encode()).hexdigest()[:16]


def _record(group: str) -> dict[str, dict[str, list[str]]]:
    """{combination: {rank: events}} for one group, from its ranks."""
    worker, ranks, args = GROUPS[group]
    runs: dict[str, dict[str, list[str]]] = {}
    for outcome in run_local_ranks(worker, ranks, args):
        for combination, events in outcome.result.items():
            runs.setdefault(combination, {})[f"rank{outcome.rank}"] = events
    return runs


def _load() -> dict:
    return json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {"sequences": {}, "groups": {}}


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_option_combination_issues_its_work_in_the_recorded_order(group):
    runs = _record(group)
    # (Megatron-Core's plain path at PP 1 is its own GPTModel forward/backward: nothing of ours to record.)
    assert runs and any(events for ranks in runs.values() for events in ranks.values())
    golden = _load()
    if os.environ.get("EP_OVERLAP_WRITE_GOLDEN") == "1":
        sequences = golden["sequences"]
        golden["groups"][group] = {}
        for combination, ranks in sorted(runs.items()):
            for events in ranks.values():
                sequences[_digest(events)] = events
            golden["groups"][group][combination] = {rank: _digest(events) for rank, events in sorted(ranks.items())}
        used = {d for g in golden["groups"].values() for ranks in g.values() for d in ranks.values()}
        golden["sequences"] = {d: sequences[d] for d in sorted(used)}
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(golden, indent=0, sort_keys=True) + "\n")
        return
    expected = golden["groups"][group]
    assert sorted(runs) == sorted(expected), "the option combinations differ from the recorded ones"
    for combination, ranks in runs.items():
        for rank, events in ranks.items():
            want = golden["sequences"][expected[combination][rank]]
            if events != want:
                first = next((i for i, (a, b) in enumerate(zip(events, want)) if a != b), min(len(events), len(want)))
                got_line = events[first] if first < len(events) else "<end>"
                want_line = want[first] if first < len(want) else "<end>"
                pytest.fail(f"{group} {combination} {rank}: event {first} is {got_line!r}, recorded {want_line!r}")
