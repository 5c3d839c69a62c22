"""Megatron-Core GPTModel and HybridModel chunks under the pipelined schedule: bitwise equal to the PP = 1 model.

A PP = 1 run on 2 ranks (EP 2) and a PP 2 x VPP 2 x EP 2 run on 4 ranks build Megatron-Core models of the same
shape, then set every weight matrix from a generator keyed by its global name (global layer number, global
expert index), so both layouts hold the same model. Each chunk is a ``GPTModel`` built with its own
``pre_process``/``post_process`` and ``vp_stage``, as Megatron-Core builds them.
"""

from dataclasses import replace
from datetime import timedelta

import pytest
import torch

from .bitwise import assert_bitwise
from .fake_deepep import install_fake_deepep
from .local_ranks import run_local_ranks
from .mcore_cpu import init_megatron, install_cpu_stubs
from .mcore_models import HybridCase, McoreCase
from .mcore_stages import build_plans, global_name
from .test_pipeline import assert_matches_reference, train_recording


def train(rank: int, world: int, case: McoreCase, pp: int, vpp: int, arms: tuple) -> dict:
    install_cpu_stubs()
    if case.dispatcher == "flex":
        install_fake_deepep()
    init_megatron(case.world, pp, vpp if pp > 1 else None)
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    from ep_overlap_lab.engine import EPOverlapEngine
    from megatron.bridge.training.ep_overlap.mcore import mcore_ep_groups

    groups = mcore_ep_groups(timedelta(seconds=30))
    data_rank = parallel_state.get_data_parallel_rank()
    out = {"data_rank": data_rank}
    # What another driver left: every chunk of the rank puts back what it found, so these come back as they were.
    found = (torch.tensor([7.0]), torch.tensor([9.0]))
    MTPLossAutoScaler.main_loss_backward_scale, MoEAuxLossAutoScaler.main_loss_backward_scale = found
    for arm in arms:
        plans = build_plans(case, pp, vpp)
        engine = EPOverlapEngine(plans if pp > 1 else plans[0], groups, overlap=arm == "overlap")
        params = [p for plan in plans for p in plan.parameters()]
        optimizer = torch.optim.Adam(params, lr=1e-2)
        named = [
            (global_name(plan, n, 2, parallel_state.get_expert_model_parallel_rank()), p)
            for plan in plans
            for n, p in plan.named_parameters()
        ]
        data = []
        for step in range(case.steps):
            gen = torch.Generator().manual_seed(100 * step + data_rank)
            data.append([tuple(torch.randint(0, 64, (2, 2, 8), generator=gen)) for _ in range(case.microbatches)])
        out[arm] = train_recording(engine, optimizer, named, data)
    left = (MTPLossAutoScaler.main_loss_backward_scale, MoEAuxLossAutoScaler.main_loss_backward_scale)
    out["scales_restored"] = all(a is b for a, b in zip(found, left))
    return out


CASES = {
    "pp2-vpp2-ep2-N2": McoreCase(layer_freq=(1, 0, 1, 1), microbatches=2, steps=3),
    "pp2-vpp2-ep2-N5-top1": McoreCase(layer_freq=(1, 1, 0, 1), topk=1, microbatches=5, steps=3),
    # HybridModel: '|' splits the pattern into PP x VPP segments; a segment may start with MoE or end dense.
    "hybrid-pp2-vpp2-ep2-N3": HybridCase(pattern="*E|E-|*-E|E*", microbatches=3, steps=2),
    "pp2-vpp2-ep2-N3-flex": McoreCase(layer_freq=(1, 0, 1, 1), microbatches=3, steps=2, dispatcher="flex"),
    "pp2-vpp2-ep2-N3-hybridep": McoreCase(
        layer_freq=(1, 0, 1, 1), microbatches=3, steps=2, dispatcher="flex", flex_backend="hybridep"
    ),
    # RoPE: a chunk without the embedding computes the rotary embedding its layers read.
    "pp2-vpp2-ep2-N3-rope": McoreCase(layer_freq=(1, 0, 1, 1), microbatches=3, steps=2, rope=True),
    "hybrid-pp2-vpp2-ep2-N3-rope": HybridCase(pattern="*E|E-|*-E|E*", microbatches=3, steps=2, rope=True),
    "pp2-vpp2-ep2-N3-mla": McoreCase(layer_freq=(1, 0, 1, 1), microbatches=3, steps=2, mla=True),
    # Full recompute, against PP = 1 keeping everything: each chunk's layer (a hybrid chunk's groups) replayed.
    "pp2-vpp2-ep2-N3-full-uniform1": McoreCase(
        layer_freq=(1, 0, 1, 1), microbatches=3, steps=2, full_recompute=("uniform", 1)
    ),
    "hybrid-pp2-vpp2-ep2-N3-full-uniform1": HybridCase(
        pattern="*E|E-|*-E|E*", microbatches=3, steps=2, full_recompute=("uniform", 1)
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_mcore_chunks_pipelined_are_bitwise_equal_to_pp1(name):
    case = CASES[name]
    kept = replace(case, full_recompute=None)
    reference = {o.result["data_rank"]: o.result["plain"] for o in run_local_ranks(train, 2, (kept, 1, 1, ("plain",)))}
    seen = set()
    for outcome in run_local_ranks(train, 4, (replace(case), 2, 2, ("plain", "overlap"))):
        ref = reference[outcome.result["data_rank"]]
        assert outcome.result["scales_restored"], f"rank {outcome.rank}: the chunks left their own loss scales"
        for arm in ("plain", "overlap"):
            assert_matches_reference(ref, outcome.result[arm], case.steps, f"rank {outcome.rank} {arm}")
            seen.update(outcome.result[arm]["params"])
    assert seen == set(reference[0]["params"]) | set(reference[1]["params"])  # the whole model, every expert


# A weight on two pipeline stages: the first stage's embedding and the last stage's copy (read by the MTP layer, or
# the tied output layer). Each stage accumulates its own use, then the engine sums the two over Megatron-Core's
# embedding group, as finalize_model_grads does. PP = 1 sums the uses per microbatch instead, so that one weight's
# gradient matches PP = 1 to rounding; everything else, bitwise.
SHARED = "embedding.word_embeddings.weight"
SHARED_CASES = {
    "pp2-vpp2-ep2-N3-mtp-rope": McoreCase(layer_freq=(1, 0, 1, 1), microbatches=3, steps=2, mtp=True, rope=True),
    "pp2-vpp2-ep2-N3-tied": McoreCase(layer_freq=(1, 0, 1, 1), microbatches=3, steps=2, tied=True),
    "hybrid-pp2-vpp2-ep2-N3-mtp-rope": HybridCase(pattern="*E|E-|*-E|E*/*E", microbatches=3, steps=2, rope=True),
}


@pytest.mark.parametrize("name", sorted(SHARED_CASES))
def test_a_weight_on_two_stages_trains_as_one(name):
    case = SHARED_CASES[name]
    reference = {o.result["data_rank"]: o.result["plain"] for o in run_local_ranks(train, 2, (case, 1, 1, ("plain",)))}
    copies = []
    for outcome in run_local_ranks(train, 4, (case, 2, 2, ("plain", "overlap"))):
        result, where = outcome.result, f"rank {outcome.rank}"
        plain, ref = result["plain"], reference[result["data_rank"]]
        assert_matches_reference(plain, result["overlap"], case.steps, f"{where} overlap vs plain")
        step0 = {"losses": plain["losses"][:1], "grads": [dict(plain["grads"][0])], "params": {}}
        shared = step0["grads"][0].pop(SHARED, None)
        assert_matches_reference(ref, step0, 1, f"{where} step 0 vs PP = 1")
        if shared is not None:
            torch.testing.assert_close(shared, ref["grads"][0][SHARED], rtol=1e-5, atol=1e-7)
            copies.append(result["overlap"]["params"][SHARED])
    assert len(copies) == 4  # both stages of both pipelines hold it
    for copy in copies[1:]:
        assert_bitwise(copies[0], copy, "the copies after the steps")
