"""The reference model's router losses weigh under the engine what Megatron-Core's driver and DDP give them, at DP 2.

Megatron-Core's ``forward_step`` scales an auxiliary loss by ``1 / N`` and its DDP averages over the data-parallel
ranks; the engine sums gradients over them and divides the main loss by the step's tokens. So the reference here
is the model run directly, microbatch by microbatch, with ``MoEAuxLossAutoScaler``'s scale ``1 / (N * dp)`` (with
``calculate_per_token_loss``: the losses times their microbatch's tokens, at ``1 / tokens``), and its non-expert
gradients summed over the ranks. Two ranks with EP 2 are data-parallel for every non-expert weight. The engine runs
in a fresh process and after another driver left its own scale, which it must find again afterwards.
"""

from datetime import timedelta

import pytest
import torch

from .local_ranks import run_local_ranks
from .workers import Case, batches

FIELDS = {
    "aux-loss": {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.5},
    "seq-aux-loss": {"moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 0.5},
    "z-loss": {"moe_z_loss_coeff": 0.2},
    "aux-z-per-token": {
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": 0.5,
        "moe_z_loss_coeff": 0.2,
        "calculate_per_token_loss": True,
    },
}


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: param.grad.clone() for name, param in model.named_parameters()}


def _engine_and_reference(rank: int, world: int, case: Case) -> dict:
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from ep_overlap_lab.engine import EPOverlapEngine
    from ep_overlap_lab.moe_gpt import MoEGPTModel

    from .local_ranks import init_ep_groups

    groups = init_ep_groups(case.ep, timedelta(seconds=30))
    data = batches(case, rank, 0)
    out = {}
    for order, left in (("fresh", None), ("after_driver", torch.tensor([7.0]))):
        MoEAuxLossAutoScaler.main_loss_backward_scale = left  # what another driver left in the process
        model = MoEGPTModel(case.config(), groups, seed=7)
        EPOverlapEngine(model, groups, overlap=True).step(data)
        out[order] = _grads(model)
        out[f"{order}_restored"] = MoEAuxLossAutoScaler.main_loss_backward_scale is left

    model = MoEGPTModel(case.config(), groups, seed=7)
    tokens = float(case.microbatches * case.micro_batch_size * case.seq_length * world)
    per_token = case.config().calculate_per_token_loss
    scale = 1.0 / tokens if per_token else 1.0 / (case.microbatches * world)
    MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor([scale])
    for tokens_BS, labels_BS in data:
        model(tokens_BS, labels_BS, tokens).backward()
    reference = _grads(model)
    for name, param in model.named_parameters():
        if getattr(param, "allreduce", True):  # expert weights: one copy per rank at EP 2 (expert-DP 1)
            torch.distributed.all_reduce(reference[name])
    out["reference"] = reference
    return out


def _without_losses(rank: int, world: int, case: Case) -> dict:
    from ep_overlap_lab.engine import EPOverlapEngine
    from ep_overlap_lab.moe_gpt import MoEGPTModel

    from .local_ranks import init_ep_groups

    groups = init_ep_groups(case.ep, timedelta(seconds=30))
    model = MoEGPTModel(case.config(), groups, seed=7)
    EPOverlapEngine(model, groups, overlap=True).step(batches(case, rank, 0))
    return _grads(model)


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_router_losses_under_the_engine_weigh_what_megatron_cores_driver_and_ddp_give(name):
    case = Case(microbatches=2, layer_freq=(1, 0, 1), extra=FIELDS[name])
    plain = run_local_ranks(_without_losses, 2, (Case(microbatches=2, layer_freq=(1, 0, 1)),))
    for outcome, without in zip(run_local_ranks(_engine_and_reference, 2, (case,)), plain):
        result = outcome.result
        assert result["fresh_restored"] and result["after_driver_restored"], "the engine left its scale behind"
        reference = result["reference"]
        for order in ("fresh", "after_driver"):
            for param, grad in reference.items():
                torch.testing.assert_close(result[order][param], grad, rtol=1e-5, atol=1e-9, msg=f"{order} {param}")
        # The losses' part of the router gradient is far above that tolerance: a factor of dp would show.
        router = "layers.0.router.weight"
        assert (reference[router] - without.result[router]).abs().max() > 1e-3 * reference[router].abs().max()
