"""Forward-only steps (evaluation) with overlap on: forwards run two by two, so each one's all-to-alls hide behind
the other's compute (Megatron-Core overlaps nothing there). Numerics are the plain evaluation's, bit for bit."""

from datetime import timedelta

import pytest
import torch

from ep_overlap_lab.engine import EPOverlapEngine
from ep_overlap_lab.moe_gpt import MoEGPTModel
from ep_overlap_lab.program.pipeline import pipeline_schedule

from .bitwise import assert_bitwise
from .local_ranks import init_ep_groups, run_local_ranks
from .workers import Case, batches


def test_forwards_go_two_by_two_and_an_odd_last_one_alone():
    steps = pipeline_schedule(1, 1, 5, 0, overlap=True, forward_only=True)
    assert [(s.forward[0], s.partner and s.partner[0]) for s in steps] == [(0, 1), (2, 3), (4, None)]
    assert all(s.phase == "forward" and s.backward is None for s in steps)
    # Without overlap, or with pipelines, one by one as before.
    assert all(s.partner is None for s in pipeline_schedule(1, 1, 5, 0, overlap=False, forward_only=True))
    assert all(s.partner is None for s in pipeline_schedule(2, 1, 4, 0, overlap=True, forward_only=True))


def _evaluate(rank: int, world: int, num_microbatches: int, chunks: int) -> dict:
    groups = init_ep_groups(2, timedelta(seconds=30))
    case = Case(microbatches=num_microbatches, layer_freq=(1, 0, 1))
    data = batches(case, rank, 0)
    out = {}
    for arm, overlap in (("plain", False), ("overlap", True)):
        model = MoEGPTModel(case.config(), groups, seed=7)
        engine = EPOverlapEngine(model, groups, overlap=overlap, moe_ep_overlap_chunks=chunks if overlap else 1)
        result = engine.step(data, forward_only=True)
        out[arm] = {
            "losses": torch.stack(result.losses),
            "requires_grad": any(loss.requires_grad for loss in result.losses),
            "grads": any(p.grad is not None for p in model.parameters()),
            "comm": [(r.op, r.layer, r.microbatch, r.phase) for r in result.recorder.comm],
        }
    return out


@pytest.mark.parametrize("num_microbatches", [1, 2, 3, 4])
def test_overlapped_evaluation_is_bitwise_the_plain_one(num_microbatches):
    for outcome in run_local_ranks(_evaluate, 2, (num_microbatches, 1)):
        plain, overlap = outcome.result["plain"], outcome.result["overlap"]
        assert_bitwise(plain["losses"], overlap["losses"], f"rank {outcome.rank} losses")
        assert not overlap["requires_grad"] and not overlap["grads"]
        comm = overlap["comm"]
        assert {phase for *_, phase in comm} == {"forward"}
        if num_microbatches >= 2:
            # Microbatch 1's first dispatch goes out before microbatch 0's first combine: they interleave.
            order = [(op, layer, mb) for op, layer, mb, _ in comm]
            assert order.index(("dispatch", 0, 1)) < order.index(("combine", 0, 0))


def test_an_odd_last_microbatch_runs_as_two_halves_when_chunked():
    for outcome in run_local_ranks(_evaluate, 2, (3, 2)):
        plain, chunked = outcome.result["plain"], outcome.result["overlap"]
        assert torch.allclose(plain["losses"], chunked["losses"], rtol=1e-5, atol=0)
        # Units: microbatches 0 and 1 whole, then the halves of microbatch 2 (units 2 and 3) beside each other.
        order = [(op, layer, mb) for op, layer, mb, _ in chunked["comm"]]
        assert {mb for _, _, mb in order} == {0, 1, 2, 3}
        assert order.index(("dispatch", 0, 3)) < order.index(("combine", 0, 2))
