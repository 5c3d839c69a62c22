"""``step()`` accumulates as autograd does: k steps without zeroing give the sum of the k steps' own gradients, bit
for bit, for dense and expert parameters, with data-parallel replicas (the all-reduce covers only each step's new
contribution), and a step that fails leaves the gradients as they were."""

from datetime import timedelta

import pytest
import torch

from ep_overlap_lab.engine import EPOverlapEngine
from ep_overlap_lab.moe_gpt import MoEGPTModel

from .bitwise import assert_bitwise
from .local_ranks import init_ep_groups, run_local_ranks
from .mcore_cpu import init_megatron, install_cpu_stubs
from .mcore_models import McoreCase, build_gpt
from .workers import Case, attach_main_grads, batches

STEPS = 3


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: (p.main_grad if hasattr(p, "main_grad") else p.grad).clone() for n, p in model.named_parameters()}


def _accumulated_and_summed(engine, model, data: list) -> tuple[dict, dict]:
    """(gradients after ``STEPS`` steps without zeroing, the sum of each step's gradient taken after zeroing)."""
    for step in range(STEPS):
        engine.step(data[step])
    accumulated = _grads(model)
    summed = None
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        for param in model.parameters():
            if hasattr(param, "main_grad"):
                param.main_grad.zero_()
        engine.step(data[step])
        grads = _grads(model)
        summed = grads if summed is None else {n: summed[n] + g for n, g in grads.items()}
    return accumulated, summed


def _reference(rank: int, world: int, main_grad: bool) -> dict:
    case = Case(world=world, microbatches=3, layer_freq=(1, 0, 1))
    groups = init_ep_groups(2, timedelta(seconds=30))
    model = MoEGPTModel(case.config(), groups, seed=7)
    if main_grad:
        attach_main_grads(model)
    engine = EPOverlapEngine(model, groups, overlap=True, delay_wgrad=True)
    accumulated, summed = _accumulated_and_summed(engine, model, [batches(case, rank, s) for s in range(STEPS)])
    experts = [n for n, p in model.named_parameters() if getattr(p, "allreduce", True) is False]
    return {"accumulated": accumulated, "summed": summed, "experts": experts}


@pytest.mark.parametrize("main_grad", [False, True])
def test_steps_without_zeroing_sum_the_steps_own_gradients_with_data_parallel_replicas(main_grad):
    # 4 ranks, EP 2: dense parameters are all-reduced over DP 4, experts over expert-DP 2.
    for outcome in run_local_ranks(_reference, 4, (main_grad,)):
        accumulated, summed = outcome.result["accumulated"], outcome.result["summed"]
        assert accumulated.keys() == summed.keys() and set(outcome.result["experts"]) < set(accumulated)
        for name, grad in accumulated.items():
            assert_bitwise(grad, summed[name], f"rank {outcome.rank} {name}")


def _mcore(rank: int, world: int) -> dict:
    install_cpu_stubs()
    init_megatron(world)
    from megatron.bridge.training.ep_overlap.mcore import McoreGPTChunk, mcore_ep_groups

    model = build_gpt(McoreCase())
    engine = EPOverlapEngine(McoreGPTChunk(model), mcore_ep_groups(timedelta(seconds=30)), overlap=True)
    data = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step + rank)
        data.append([tuple(torch.randint(0, 64, (2, 2, 8), generator=gen)) for _ in range(3)])
    accumulated, summed = _accumulated_and_summed(engine, model, data)
    return {"accumulated": accumulated, "summed": summed}


def test_megatron_core_gradients_accumulate_across_steps_the_same_way():
    for outcome in run_local_ranks(_mcore, 2, ()):
        accumulated, summed = outcome.result["accumulated"], outcome.result["summed"]
        assert any("experts" in n for n in accumulated)
        for name, grad in accumulated.items():
            assert_bitwise(grad, summed[name], f"rank {outcome.rank} {name}")


def _failing_step(rank: int, world: int) -> dict:
    case = Case(microbatches=2)
    groups = init_ep_groups(2, timedelta(seconds=30))
    model = MoEGPTModel(case.config(), groups, seed=7)
    engine = EPOverlapEngine(model, groups, overlap=True)
    engine.step(batches(case, rank, 0))
    before = _grads(model)
    data = batches(case, rank, 1)
    with torch.no_grad():
        model.word_embeddings.weight[3] = float("nan")  # any microbatch that reads token 3 goes NaN
    for tokens, _ in data:
        tokens[0, 0] = 3
    try:
        engine.step(data)
    except FloatingPointError as error:
        return {"before": before, "after": _grads(model), "error": str(error)}
    return {"error": None}


def test_a_failed_step_leaves_the_gradients_as_they_were():
    for outcome in run_local_ranks(_failing_step, 2, ()):
        result = outcome.result
        assert result["error"] and "is not finite" in result["error"]
        for name, grad in result["before"].items():
            assert_bitwise(grad, result["after"][name], f"rank {outcome.rank} {name}")
