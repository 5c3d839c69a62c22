"""Overlap on vs off (and delayed wgrad on vs off): every loss, gradient and updated parameter is bitwise equal.

Each case trains a fresh model per arm for several optimizer steps on 2 or 4 gloo ranks, and compares bit
patterns, so -0.0 vs 0.0 or a NaN would count as a difference.
"""

import pytest
import torch

from .bitwise import assert_bitwise, assert_same_training
from .local_ranks import run_local_ranks
from .workers import ARMS, Case, train_arms

EXPERT_BIAS = {
    "moe_router_score_function": "sigmoid",
    "moe_router_enable_expert_bias": True,
    "moe_router_bias_update_rate": 0.05,
}
ROUTER_LOSSES_AND_SHARED = {
    "moe_router_load_balancing_type": "aux_loss",
    "moe_aux_loss_coeff": 0.1,
    "moe_z_loss_coeff": 0.01,
    "moe_shared_expert_intermediate_size": 24,
}
CASES = {
    "ep2-fp32-top1-N1": Case(topk=1, microbatches=1),
    "ep2-fp32-top2-N2": Case(microbatches=2),
    "ep2-fp32-top2-N4-mixed": Case(layer_freq=(1, 0, 1)),
    "ep2-bf16-top2-N4": Case(bf16=True),
    "ep2-bf16-top1-N4": Case(bf16=True, topk=1),
    "ep4-fp32-top2-N4": Case(world=4, ep=4, experts=8, layer_freq=(1, 1)),
    "ep4-bf16-top1-N2": Case(world=4, ep=4, experts=8, bf16=True, topk=1, microbatches=2, layer_freq=(0, 1)),
    # 4 tokens per microbatch, top-1, 8 experts: at least half the experts get no token from a rank.
    "ep2-zero-token-experts": Case(experts=8, topk=1, seq_length=4, micro_batch_size=1, layer_freq=(1, 1)),
    # 4 ranks with EP 2: expert weights replicated over an expert-DP group of 2.
    "world4-ep2-expert-dp": Case(world=4, ep=2, microbatches=2, layer_freq=(1,)),
    "ep2-fp32-main-grad": Case(main_grad=True),
    "ep2-bf16-main-grad": Case(bf16=True, main_grad=True),
    "ep4-bf16-main-grad": Case(world=4, ep=4, experts=8, bf16=True, main_grad=True, layer_freq=(1, 0)),
    # The attention wgrad in window 2 of the next layer step instead of window 1.
    "ep2-fp32-wgrad-window2-mixed": Case(layer_freq=(1, 0, 1), arms=ARMS + ("delayed_window2",)),
    "ep2-bf16-wgrad-window2-main-grad": Case(bf16=True, main_grad=True, arms=ARMS + ("delayed_window2",)),
    # The engine places the attention wgrad itself: its first step runs plain, the rest in the chosen window.
    "ep2-fp32-wgrad-auto-mixed": Case(layer_freq=(1, 0, 1), arms=("plain", "delayed_auto")),
    # Every all-to-all launched on the host thread (the lane's path for layers that do not allow the helper thread).
    "ep2-fp32-launch-on-host-mixed": Case(layer_freq=(1, 0, 1), arms=("plain", "overlap_onhost", "delayed_onhost")),
    # Aux-loss-free load balancing: the routing biases move after every step, so later steps route differently.
    "ep2-fp32-expert-bias-mixed": Case(layer_freq=(1, 0, 1), extra=EXPERT_BIAS),
    "ep4-bf16-top1-expert-bias": Case(
        world=4, ep=4, experts=8, bf16=True, topk=1, layer_freq=(1, 1), extra=EXPERT_BIAS
    ),
    # Router losses (their backward scale set per engine step) and shared experts (kept for combine beside probs).
    "ep2-fp32-router-losses-shared-mixed": Case(layer_freq=(1, 0, 1), extra=ROUTER_LOSSES_AND_SHARED),
    "ep2-bf16-seq-aux-loss-sigmoid": Case(
        bf16=True,
        extra={
            "moe_router_load_balancing_type": "seq_aux_loss",
            "moe_aux_loss_coeff": 0.1,
            "moe_router_score_function": "sigmoid",
        },
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_overlap_and_delayed_wgrad_are_bitwise_equal_to_plain(name):
    case = CASES[name]
    outcomes = run_local_ranks(train_arms, case.world, (case,))
    for outcome in outcomes:
        rank, arms = outcome.rank, outcome.result
        plain = arms["plain"]
        for arm in case.arms[1:]:
            other = arms[arm]
            assert_same_training(plain, other, case.steps, f"rank {rank} {arm}")
            for name, bias in plain["biases"].items():
                assert_bitwise(bias, other["biases"][name], f"rank {rank} {arm} final {name}")
        if case.extra.get("moe_router_enable_expert_bias"):  # the biases moved, and identically on every rank
            assert plain["biases"] and all(b.abs().sum() > 0 for b in plain["biases"].values())
            first = outcomes[0].result["plain"]["biases"]
            assert all(torch.equal(b, first[name]) for name, b in plain["biases"].items())
        # The comparison means something only if gradients flowed everywhere they should.
        last = plain["grads"][-1]
        assert all(torch.isfinite(g).all() for g in last.values())
        for needle in ("router.weight", "attention.qkv.weight", "word_embeddings.weight"):
            assert any(g.abs().sum() > 0 for n, g in last.items() if needle in n), f"no gradient reached {needle}"
        assert torch.isfinite(plain["losses"][-1]).all()


def test_expert_grads_are_nonzero_somewhere():
    case = Case(steps=1, arms=("overlap",))
    outcomes = run_local_ranks(train_arms, case.world, (case,))
    for outcome in outcomes:
        grads = outcome.result["overlap"]["grads"][0]
        expert = [g for name, g in grads.items() if name.endswith(("fc1.weight", "fc2.weight")) and g.dim() == 3]
        assert expert and all(g.abs().sum() > 0 for g in expert)


def test_losses_decrease_over_steps():
    case = Case(steps=6, arms=("overlap",), same_data_every_step=True)
    outcomes = run_local_ranks(train_arms, case.world, (case,))
    losses = [step.sum().item() for step in outcomes[0].result["overlap"]["losses"]]
    assert losses[-1] < losses[0]
