"""The engine's auxiliary losses weigh what Megatron-Core's do: its driver, then its DDP's averaging, at DP 2.

The reference is Megatron-Core's ``forward_backward_no_pipelining`` with the plain model, followed by what its
``DistributedDataParallel`` and ``finalize_model_grads`` do to the gradients: each one scaled by ``1 / dp`` and summed
over its data-parallel group (expert weights over the expert-data-parallel group), or, with
``calculate_per_token_loss``, summed and divided by the step's token count. Two ranks with EP 2 are data-parallel
for every non-expert weight (DP 2). Each case runs in both orders in one process: the engine in a fresh process and
then the driver (which must still run after it), and the driver first, then the engine (whose result no state
left by the driver may change). Sizes are powers of two, so the two sums round alike and the gradients match bit
for bit.
"""

from dataclasses import replace
from datetime import timedelta

import pytest
import torch

from .bitwise import assert_bitwise
from .local_ranks import run_local_ranks
from .mcore_cpu import init_megatron, install_cpu_stubs
from .mcore_models import McoreCase, build_gpt

SEQ, BATCH, MICROBATCHES = 8, 2, 2


def _data(rank: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return [tuple(torch.randint(0, 64, (2, BATCH, SEQ), generator=gen)) for _ in range(MICROBATCHES)]


def _forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    loss_mask = torch.ones_like(labels, dtype=torch.float)
    positions = torch.arange(SEQ)[None].expand_as(tokens)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    output = model(input_ids=tokens, position_ids=positions, attention_mask=mask, labels=labels, loss_mask=loss_mask)

    def loss_func(per_token_BS):
        loss = (per_token_BS.view(-1).float() * loss_mask.view(-1)).sum()
        count = loss_mask.sum().to(torch.int)
        return loss, count, {"lm loss": torch.cat([loss.detach().view(1), count.view(1)])}

    return output, loss_func


def _driver_then_ddp(case: McoreCase, rank: int) -> list[dict]:
    """Per step: Megatron-Core's driver, then its DDP's averaging and finalize_model_grads' per-token division."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model = build_gpt(case)
    dp_group = parallel_state.get_data_parallel_group()
    steps = []
    for step in range(case.steps):
        data = _data(rank, step)
        model.zero_grad(set_to_none=True)
        get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=iter(data), model=[model],
            num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=BATCH, forward_only=False,
        )  # fmt: skip
        tokens = torch.tensor(float(sum(labels.numel() for _, labels in data)))
        torch.distributed.all_reduce(tokens)
        grads = {}
        for name, param in model.named_parameters():
            expert = not getattr(param, "allreduce", True)
            grad = param.grad.clone()
            if not case.per_token_loss:
                grad *= 1.0 / torch.distributed.get_world_size(dp_group)
            group = parallel_state.get_expert_data_parallel_group() if expert else dp_group
            torch.distributed.all_reduce(grad, group=group)
            if case.per_token_loss:
                grad /= tokens
            grads[name] = grad
        steps.append(grads)
    return steps


def _engine(case: McoreCase, rank: int) -> list[dict]:
    from ep_overlap_lab.engine import EPOverlapEngine
    from megatron.bridge.training.ep_overlap.mcore import chunk_for, mcore_ep_groups

    model = build_gpt(case)
    engine = EPOverlapEngine(chunk_for(model), mcore_ep_groups(timedelta(seconds=30)), overlap=True)
    steps = []
    for step in range(case.steps):
        model.zero_grad(set_to_none=True)
        engine.step(_data(rank, step))
        steps.append({name: param.grad.clone() for name, param in model.named_parameters()})
    return steps


def _both_orders(rank: int, world: int, case: McoreCase) -> dict:
    install_cpu_stubs()
    init_megatron(world)
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    fresh = _engine(case, rank)
    after_engine = _driver_then_ddp(case, rank)  # the driver still runs after the engine ...
    driver = _driver_then_ddp(case, rank)
    left = (MTPLossAutoScaler.main_loss_backward_scale, MoEAuxLossAutoScaler.main_loss_backward_scale)
    after_driver = _engine(case, rank)  # ... and the engine's result does not depend on what the driver left
    restored = (MTPLossAutoScaler.main_loss_backward_scale, MoEAuxLossAutoScaler.main_loss_backward_scale)
    return {
        "fresh": fresh,
        "after_driver": after_driver,
        "driver": driver,
        "after_engine": after_engine,
        "restored": all(a is b for a, b in zip(left, restored)),
    }


BASE = McoreCase(world=2, microbatches=MICROBATCHES, steps=2)
CASES = {
    "mtp": replace(BASE, mtp=True),
    "aux-loss": replace(BASE, load_balancing="aux_loss", aux_loss_coeff=0.25),
    "z-loss": replace(BASE, z_loss_coeff=0.5),
    "mtp-aux-z-per-token": replace(
        BASE, mtp=True, load_balancing="aux_loss", aux_loss_coeff=0.25, z_loss_coeff=0.5, per_token_loss=True
    ),
}


def _assert_grads(expected: list[dict], got: list[dict], where: str) -> None:
    assert len(expected) == len(got), where
    for step, (want, have) in enumerate(zip(expected, got)):
        assert sorted(want) == sorted(have), where
        for name, grad in want.items():
            assert_bitwise(grad, have[name], f"{where}, step {step}: {name}")


@pytest.mark.lab
@pytest.mark.parametrize("name", sorted(CASES))
def test_engine_gradients_equal_megatron_cores_driver_and_ddp_at_dp_2(name):
    for outcome in run_local_ranks(_both_orders, 2, (CASES[name],)):
        result = outcome.result
        assert result["restored"], "the engine left its own auxiliary-loss scales behind"
        _assert_grads(result["driver"], result["after_engine"], f"rank {outcome.rank}: driver after the engine")
        _assert_grads(result["driver"], result["fresh"], f"rank {outcome.rank}: engine in a fresh process")
        _assert_grads(result["driver"], result["after_driver"], f"rank {outcome.rank}: engine after the driver")


def _weighted_names(rank: int, world: int, case: McoreCase) -> list[str]:
    """The parameters whose gradients the auxiliary loss changes (so the comparison above can see its weight)."""
    install_cpu_stubs()
    init_megatron(world)
    with_loss = _engine(case, rank)[0]
    without = _engine(replace(case, mtp=False, load_balancing="none", aux_loss_coeff=0.0, z_loss_coeff=None), rank)[0]
    return sorted(n for n, g in with_loss.items() if n in without and not torch.equal(g, without[n]))


@pytest.mark.lab
def test_each_auxiliary_loss_reaches_the_gradients_it_should():
    changed = {}
    for name in ("aux-loss", "z-loss"):
        changed[name] = run_local_ranks(_weighted_names, 2, (CASES[name],))[0].result
    for name, names in changed.items():
        assert any("router" in n for n in names), f"{name}: the router's gradient did not change: {names}"
