"""Every runner of the schedule program can run exactly the ops of ``program.ops.OPS``, called as the interpreter
calls them, and every op of the table is one the program lays out.

The runners: the engine's nodes (``LayerNodes``, ``MicrobatchNodes``; the hook runs these too) and its plain run
(``PlainRun``), the simulator's charges and the memory count's holds. For each the table names a method
(``OpSpec.method``); these tests check what the table does not guarantee by itself: that each runner class has that
method, none that no op names, and takes what ``interpreter.run_ops`` hands it (one argument for an op that reads
its unit's activation or gradient, none otherwise); that ops at a layer, at a chunk's ends and of a whole chunk
are where the program puts them; and that the program lays out every op of the table somewhere (none is dead).
"""

import importlib
import inspect
import re

import pytest

from ep_overlap_lab.engine.plain import PlainRun
from ep_overlap_lab.program.runners import (
    CHUNK_END_OPS,
    LAYER_OPS,
    PLAIN_OPS,
    ChunkRunner,
    LayerRunner,
    PlainRunner,
    runner_protocol,
)
from ep_overlap_lab.program.steps import program
from megatron.bridge.training.ep_overlap.options import EPOverlapOptions
from megatron.bridge.training.ep_overlap.program.ops import OPS, OpKind, OpSpec
from megatron.bridge.training.ep_overlap.program.steps import ChunkShape
from megatron.bridge.training.ep_overlap.runtime.nodes import LayerNodes, MicrobatchNodes

from .program_events import rank_chunks

# The planner package's names shadow its submodules (``planner.simulate`` is the function): import the modules.
simulate = importlib.import_module("ep_overlap_lab.planner.simulate")
memory = importlib.import_module("ep_overlap_lab.planner.memory")

RUNNERS = {
    LayerNodes: (LAYER_OPS,),
    MicrobatchNodes: (CHUNK_END_OPS,),
    PlainRun: (PLAIN_OPS,),
    simulate._LayerCharge: (LAYER_OPS,),
    simulate._UnitCharge: (CHUNK_END_OPS, PLAIN_OPS),
    memory._LayerHolds: (LAYER_OPS,),
    memory._ChunkHolds: (CHUNK_END_OPS, PLAIN_OPS),
}
IDS = [f"{r.__module__.rsplit('.', 1)[-1]}.{r.__name__}" for r in RUNNERS]
_OP_METHOD = re.compile(r"^(compute|launch|wait|wgrad|plain)_")


def coverage(runner: type, op_sets) -> tuple[list[str], list[str]]:
    """The ops' methods ``runner`` lacks, and its op-shaped methods that no op of ``op_sets`` names."""
    expected = {OPS[op].method for ops in op_sets for op in ops}
    missing = sorted(method for method in expected if not callable(getattr(runner, method, None)))
    extra = sorted(name for name in dir(runner) if _OP_METHOD.match(name) and name not in expected)
    return missing, extra


def call_problems(runner: type, op_sets) -> list[str]:
    """The ops whose method ``runner`` cannot be called with what the interpreter hands it: the unit's value for an
    op that reads one (``OpSpec.reads``), nothing otherwise."""
    problems = []
    for op in sorted(op for ops in op_sets for op in ops):
        spec = OPS[op]
        if not callable(getattr(runner, spec.method, None)):
            continue  # missing: coverage() says so
        signature = inspect.signature(getattr(runner, spec.method))
        given = (object(),) if spec.reads else ()
        try:
            signature.bind(object(), *given)  # self, then the argument run_ops passes
        except TypeError as error:
            problems.append(f"{spec.method}{signature} given {len(given)} argument(s): {error}")
    return problems


@pytest.mark.parametrize("runner", list(RUNNERS), ids=IDS)
def test_every_runner_has_exactly_the_methods_the_table_names(runner):
    assert coverage(runner, RUNNERS[runner]) == ([], [])
    for ops, protocol in ((LAYER_OPS, LayerRunner), (CHUNK_END_OPS, ChunkRunner), (PLAIN_OPS, PlainRunner)):
        if ops in RUNNERS[runner]:
            assert isinstance(runner.__new__(runner), protocol)


@pytest.mark.parametrize("runner", list(RUNNERS), ids=IDS)
def test_every_runner_takes_what_the_interpreter_hands_each_op(runner):
    assert call_problems(runner, RUNNERS[runner]) == []


def test_a_method_that_takes_the_wrong_arguments_is_found():
    class Reads(LayerNodes):
        def compute_pre_dispatch(self) -> None:  # forgets the activation it reads
            """Broken on purpose."""

        def launch_dispatch(self, extra) -> None:  # wants an argument nobody passes
            """Broken on purpose."""

    assert [p.split("(")[0] for p in call_problems(Reads, (LAYER_OPS,))] == ["compute_pre_dispatch", "launch_dispatch"]


def test_an_op_added_to_the_table_without_a_runner_fails_every_runner_of_its_kind(monkeypatch):
    monkeypatch.setitem(OPS, (OpKind.COMPUTE, "shared_expert_node"), OpSpec("compute_shared_expert_node"))
    monkeypatch.setitem(OPS, (OpKind.COMPUTE, "embedding_norm"), OpSpec("compute_embedding_norm", at="ends"))
    layer_ops = LAYER_OPS | {(OpKind.COMPUTE, "shared_expert_node")}
    chunk_ops = CHUNK_END_OPS | {(OpKind.COMPUTE, "embedding_norm")}
    for runner, op_sets in RUNNERS.items():
        if op_sets == (PLAIN_OPS,):
            continue  # no op of these kinds
        grown = tuple(layer_ops if ops is LAYER_OPS else chunk_ops if ops is CHUNK_END_OPS else ops for ops in op_sets)
        missing, _ = coverage(runner, grown)
        assert missing, runner
    assert not isinstance(LayerNodes.__new__(LayerNodes), runner_protocol("Grown", layer_ops))


# ---- the table against the program: every op laid out somewhere, each where the table says ----------------------


def _laid_out() -> set:
    """Every op of a few programs: plain, overlapped with delayed wgrad, PP 2 x VPP 2 (both ranks), full recompute."""
    ops = set()
    for pp, freq, rank in ((1, [1, 0, 1], 0), (2, [1, 0, 1, 1], 0), (2, [1, 0, 1, 1], 1)):
        shapes, _ = rank_chunks(freq, pp, rank)
        for fields in ({"overlap": False}, {"delay_wgrad": True}):
            ops |= {op for step in program(EPOverlapOptions(**fields), shapes, 5, pipeline_size=pp, rank=rank)
                    for op in step.ops}  # fmt: skip
    recomputed = ChunkShape(True, True, (True, False, True), ((0, 1), (1, 2), (2, 3)))
    ops |= {op for step in program(EPOverlapOptions(delay_wgrad=True), [recomputed], 3) for op in step.ops}
    return ops


LAID_OUT = _laid_out()


def test_every_op_of_the_table_is_laid_out_by_the_program():
    assert set(OPS) - {(op.kind, op.name) for op in LAID_OUT} == set()


def test_every_op_runs_on_the_runner_the_table_says():
    at_a_layer = {(op.kind, op.name) for op in LAID_OUT if op.layer is not None}
    at_the_ends = {(op.kind, op.name) for op in LAID_OUT if op.layer is None}
    assert at_a_layer == set(LAYER_OPS)
    assert at_the_ends == set(CHUNK_END_OPS | PLAIN_OPS)


def test_every_method_the_table_names_is_its_ops_kind_and_name():
    """The naming rule the docs state (op ``(kind, name)`` runs as ``<kind>_<name>``), which the table spells out."""
    assert [spec.method for (kind, name), spec in OPS.items() if spec.method != f"{kind}_{name}"] == []
