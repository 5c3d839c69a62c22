"""Every runner of the schedule program has exactly the ops of ``program.ops.OPS``: none missing, none extra.

The runners: the engine's nodes (``LayerNodes``, ``MicrobatchNodes``; the hook runs these too) and its plain run
(``PlainRun``), the simulator's charges and the memory count's holds. Each is checked against the protocols
generated from ``OPS`` (``LayerRunner``, ``ChunkRunner``, ``PlainRunner``); a new op in ``OPS`` that a runner lacks
fails here (the second test adds one to show it).
"""

import importlib
import re

import pytest

from megatron.bridge.training.ep_overlap.engine.nodes import LayerNodes, MicrobatchNodes
from megatron.bridge.training.ep_overlap.engine.plain import PlainRun
from megatron.bridge.training.ep_overlap.program.ops import (
    CHUNK_END_OPS,
    LAYER_OPS,
    OPS,
    PLAIN_OPS,
    ChunkRunner,
    LayerRunner,
    PlainRunner,
    runner_protocol,
)

# The planner package's names shadow its submodules (``planner.simulate`` is the function): import the modules.
simulate = importlib.import_module("megatron.bridge.training.ep_overlap.planner.simulate")
memory = importlib.import_module("megatron.bridge.training.ep_overlap.planner.memory")

RUNNERS = {
    LayerNodes: (LAYER_OPS,),
    MicrobatchNodes: (CHUNK_END_OPS,),
    PlainRun: (PLAIN_OPS,),
    simulate._LayerCharge: (LAYER_OPS,),
    simulate._UnitCharge: (CHUNK_END_OPS, PLAIN_OPS),
    memory._LayerHolds: (LAYER_OPS,),
    memory._ChunkHolds: (CHUNK_END_OPS, PLAIN_OPS),
}
_OP_METHOD = re.compile(r"^(compute|launch|wait|wgrad|plain)_")


def coverage(runner: type, op_sets) -> tuple[list[str], list[str]]:
    """The ops ``runner`` lacks, and its op-shaped methods that no op of ``op_sets`` names."""
    expected = {f"{kind}_{name}" for ops in op_sets for kind, name in ops}
    missing = sorted(method for method in expected if not callable(getattr(runner, method, None)))
    extra = sorted(name for name in dir(runner) if _OP_METHOD.match(name) and name not in expected)
    return missing, extra


@pytest.mark.parametrize("runner", list(RUNNERS), ids=lambda r: f"{r.__module__.rsplit('.', 1)[-1]}.{r.__name__}")
def test_every_runner_has_exactly_the_ops_of_the_table(runner):
    assert coverage(runner, RUNNERS[runner]) == ([], [])
    for ops, protocol in ((LAYER_OPS, LayerRunner), (CHUNK_END_OPS, ChunkRunner), (PLAIN_OPS, PlainRunner)):
        if ops in RUNNERS[runner]:
            assert isinstance(runner.__new__(runner), protocol)


def test_an_op_added_to_the_table_without_a_runner_fails_every_runner_of_its_kind():
    added = {("compute", "shared_expert_node"), ("compute", "embedding_norm")}
    layer_ops = LAYER_OPS | {added.pop()}
    chunk_ops = CHUNK_END_OPS | added
    for runner, op_sets in RUNNERS.items():
        if op_sets == (PLAIN_OPS,):
            continue  # no op of these kinds
        grown = tuple(layer_ops if ops is LAYER_OPS else chunk_ops if ops is CHUNK_END_OPS else ops for ops in op_sets)
        missing, _ = coverage(runner, grown)
        assert missing, runner
    assert not isinstance(LayerNodes.__new__(LayerNodes), runner_protocol("Grown", layer_ops))


def test_the_op_sets_split_the_table():
    assert LAYER_OPS | CHUNK_END_OPS | PLAIN_OPS == set(OPS)
    assert not LAYER_OPS & CHUNK_END_OPS and not (LAYER_OPS | CHUNK_END_OPS) & PLAIN_OPS
