"""Full activation recompute inside the overlapped schedule: no number changes, the replay is in the program.

Each case trains the reference model with ``recompute_granularity="full"`` on every arm of ``workers.train_arms``
(plain path, overlap, delayed wgrad, edge pairing, chunks) and compares every loss, gradient, final parameter and
expert bias, bit for bit, with the plain path keeping everything.
"""

import contextlib
import io
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from megatron.bridge.models.moe_gpt import MoEGPTModel
from megatron.bridge.training.ep_overlap import EPOverlapEngine
from megatron.bridge.utils.multiprocess import run_local_ranks

from .test_numerics import EXPERT_BIAS, ROUTER_LOSSES_AND_SHARED, assert_bitwise, assert_same_training
from .test_pipeline import PIPELINE_ARMS, PipeCase, assert_matches_reference, train_layout
from .test_saved_activations import _config, _measured_and_planned
from .workers import Case, train_arms


def full(method: str = "uniform", layers: int = 1) -> dict:
    return {"recompute_granularity": "full", "recompute_method": method, "recompute_num_layers": layers}


ARMS = ("plain", "overlap", "delayed", "delayed_edges", "delayed_window2")
CASES = {
    "fp32-uniform1": Case(arms=ARMS, extra=full()),
    "bf16-uniform1-router-losses-shared": Case(bf16=True, arms=ARMS, extra={**full(), **ROUTER_LOSSES_AND_SHARED}),
    "fp32-uniform2-expert-bias": Case(arms=ARMS, extra={**full("uniform", 2), **EXPERT_BIAS}),
    "fp32-block1": Case(arms=ARMS, extra=full("block", 1)),
    # Chunked unpaired phases: bitwise the plain path over the halves (chunking's own bound), recomputing or not.
    "fp32-uniform1-chunks": Case(arms=("plain_units", "delayed_chunks"), extra=full()),
}


def _kept(case: Case) -> Case:
    """The same case keeping every activation, on its plain arm."""
    extra = {k: v for k, v in case.extra.items() if not k.startswith("recompute")}
    return replace(case, arms=(case.arms[0],), extra=extra)


def _both(rank: int, world: int, case: Case) -> dict:
    return {"kept": train_arms(rank, world, _kept(case))[case.arms[0]], **train_arms(rank, world, case)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_full_recompute_changes_no_number(name):
    case = CASES[name]
    for outcome in run_local_ranks(_both, case.world, (case,)):
        runs = outcome.result
        for arm in case.arms:
            where = f"rank {outcome.rank} {arm} {name}"
            assert_same_training(runs["kept"], runs[arm], case.steps, where)
            for bias, value in runs["kept"]["biases"].items():
                assert_bitwise(value, runs[arm]["biases"][bias], f"{where} {bias}")
            if arm != case.arms[0]:  # the overlapped arms replayed: their replay all-to-alls ran on the lane
                assert {"replay_dispatch", "replay_combine"} <= {r["op"] for r in runs[arm]["comm"]}, arm


PIPE_CASES = {
    "pp2-vpp2-uniform1-N4": PipeCase(microbatches=4, extra=full()),
    # A two-layer segment in a chunk that pairs with shorter ones: replayed inside paired and unpaired steps.
    "pp2-vpp2-uniform2-unequal-chunks-N4": PipeCase(
        layer_freq=(1, 1, 0, 1, 1, 0),
        first_stage=2,
        last_stage=4,
        custom_chunks=((0,), (1, 2), (3, 4), (5,)),
        microbatches=4,
        extra=full("uniform", 2),
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", sorted(PIPE_CASES))
def test_pipelined_full_recompute_is_bitwise_pp1_keeping_everything(name):
    case = PIPE_CASES[name]
    kept = replace(case, extra={k: v for k, v in case.extra.items() if not k.startswith("recompute")})
    reference = {
        o.result["data_rank"]: o.result["plain"] for o in run_local_ranks(train_layout, 2, (kept, 1, 1, ("plain",)))
    }
    for outcome in run_local_ranks(train_layout, 4, (case, 2, 2, PIPELINE_ARMS)):
        for arm in PIPELINE_ARMS:
            where = f"rank {outcome.rank} {arm}"
            assert_matches_reference(reference[outcome.result["data_rank"]], outcome.result[arm], case.steps, where)


MEMORY_CASES = {
    "fp32-uniform1": {**full()},
    "bf16-rmsnorm-swiglu-uniform2": {**full("uniform", 2), "normalization": "RMSNorm", "bf16": True,
                                     "gated_linear_unit": True},
    "fp32-block1-aux-z-loss": {**full("block", 1), "moe_router_load_balancing_type": "aux_loss",
                               "moe_aux_loss_coeff": 0.1, "moe_z_loss_coeff": 0.01},
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(MEMORY_CASES))
def test_the_planner_counts_what_a_recomputed_segment_holds_exactly(name):
    """Forward keeps each segment's input, the replay what the forward would have saved: the planner's walk of the
    program (planner/memory.py) against the engine's count (engine/saved.py), byte for byte, every schedule option;
    and recomputing holds less than keeping everything."""
    config = _config(**MEMORY_CASES[name])
    kept = _config(**{k: v for k, v in MEMORY_CASES[name].items() if not k.startswith("recompute")})
    full_runs = run_local_ranks(_measured_and_planned, 2, (config, 4))
    kept_runs = run_local_ranks(_measured_and_planned, 2, (kept, 4))
    for outcome, kept_outcome in zip(full_runs, kept_runs):
        for option, (measured, planned) in outcome.result.items():
            assert planned == measured, f"rank {outcome.rank} {option}: planned {planned}, measured {measured}"
            assert measured < kept_outcome.result[option][0], option


def _doc_snippet(rank: int, world: int) -> dict:
    """The full-recompute snippet of ep-overlap-schedule.md, run as written, then one step beside the same model
    keeping everything."""
    doc = (Path(__file__).resolve().parents[4] / "docs/training/ep-overlap-schedule.md").read_text()
    snippet = re.search(r"### Full recompute[^\n]*\n.*?```python\n(.*?)```", doc, re.S).group(1)
    namespace: dict = {}
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        exec(snippet, namespace)
    engine, config, groups = namespace["engine"], namespace["config"], namespace["groups"]
    data = [(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))) for _ in range(4)]
    kept = replace(config, recompute_granularity=None, recompute_method=None, recompute_num_layers=None)
    plain = EPOverlapEngine(MoEGPTModel(kept, groups), groups, overlap=False)
    return {
        "printed": printed.getvalue(),
        "losses": [engine.step(data).losses, plain.step(data).losses],
        "grads": [[p.grad for p in m.parameters()] for m in (namespace["model"], plain.model)],
    }


def test_the_full_recompute_snippet_runs_as_written():
    for outcome in run_local_ranks(_doc_snippet, 2, ()):
        result = outcome.result
        printed = result["printed"].splitlines()
        assert printed[:3] == ["compute replay_input u0 L1", "compute replay_pre_dispatch u0 L1",
                               "launch replay_dispatch u0 L1"], printed  # fmt: skip
        for a, b in zip(*result["losses"]):
            assert_bitwise(a, b, f"rank {outcome.rank} loss")
        for a, b in zip(*result["grads"]):
            assert_bitwise(a, b, f"rank {outcome.rank} grad")
