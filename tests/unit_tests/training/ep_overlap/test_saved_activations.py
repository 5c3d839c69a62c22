"""The activation figure: bytes held for backward, counted exactly (engine/saved.py), and what the schedules hold."""

from datetime import timedelta

import torch

from megatron.bridge.models.moe_gpt.grouped_linear import GroupedLinear
from megatron.bridge.models.moe_gpt.model import MoEGPTModel
from megatron.bridge.training.ep_overlap import EPOverlapEngine
from megatron.bridge.training.ep_overlap.engine.saved import SavedActivations
from megatron.bridge.utils.multiprocess import run_local_ranks
from megatron.bridge.utils.process_groups import init_ep_groups

from .workers import Case

FP32 = 4


def test_what_autograd_saves_is_counted_once_per_storage_and_released_by_backward():
    w_KN = torch.nn.Parameter(torch.randn(8, 16))
    x_MK = torch.randn(4, 8, requires_grad=True)
    with SavedActivations([w_KN]) as saved:
        a_MN = x_MK @ w_KN  # saves x and w; w is a parameter, not an activation
        b_MN = torch.relu(a_MN)  # saves its result
        c_MN = b_MN * b_MN  # saves b twice: one storage, counted once
        held = saved.current_bytes
        c_MN.sum().backward()
        assert saved.current_bytes == 0
    assert held == saved.peak_bytes == (4 * 8 + 4 * 16) * FP32


def test_a_delayed_weight_gradient_holds_its_inputs_until_it_runs():
    linear = GroupedLinear(2, 8, 16)
    torch.nn.init.normal_(linear.weight)
    linear.delay_wgrad = True
    x_MK = torch.randn(6, 8, requires_grad=True)
    with SavedActivations(linear.parameters()) as saved:
        linear(x_MK, (2, 4)).sum().backward()  # dgrad now; wgrad queued with x and the output gradient
        assert saved.current_bytes == (6 * 8 + 6 * 16) * FP32
        linear.backward_dw()
        assert saved.current_bytes == 0
    assert linear.weight.grad is not None


CASE = Case(layer_freq=(0, 0))  # dense layers: every microbatch holds the same bytes


def _peaks(rank: int, world: int, microbatches: int) -> dict:
    groups = init_ep_groups(world, timedelta(seconds=30))
    out = {}
    for arm, overlap in (("plain", False), ("overlap", True)):
        model = MoEGPTModel(CASE.config(), groups)
        engine = EPOverlapEngine(model, groups, overlap=overlap)
        gen = torch.Generator().manual_seed(rank)
        V, S = CASE.config().vocab_size, CASE.config().seq_length
        data = [tuple(torch.randint(0, V, (2, 2, S), generator=gen)) for _ in range(microbatches)]
        out[arm] = [engine.step(data).activation_peak_bytes for _ in range(2)]
    return out


def test_plain_1f1b_holds_one_microbatch_and_a_paired_step_holds_two_at_most():
    one = run_local_ranks(_peaks, 2, (1,))[0].result
    four = run_local_ranks(_peaks, 2, (4,))[0].result
    per_microbatch = one["plain"][0]
    assert per_microbatch > 0
    # Deterministic: the same every step; the plain path frees each microbatch before the next starts.
    assert one["plain"] == four["plain"] == [per_microbatch] * 2
    assert four["overlap"][0] == four["overlap"][1]
    # A paired step holds the forward microbatch while the backward one is still alive, never a third.
    assert per_microbatch < four["overlap"][0] <= 2 * per_microbatch
