"""Planner costs from a model shape: FLOPs and bytes scale as they should, links split by node."""

import pytest

from ep_overlap_lab.planner.cost_model import (
    PROFILES,
    QWEN3_30B_A3B,
    SHAPES,
    Layout,
    _effective_bandwidth,
    costs_from_model,
)

H100 = PROFILES["H100"]


def test_every_profile_figure_says_where_it_comes_from():
    for profile in PROFILES.values():
        for figure in ("peak_flops", "nvlink_Bps", "network_Bps", "compute_efficiency", "comm_efficiency"):
            assert profile.sources[figure]
        assert "assumption" in profile.sources["compute_efficiency"]


def test_ep_within_a_node_runs_on_nvlink_and_beyond_it_on_the_network():
    assert _effective_bandwidth(8, H100) == pytest.approx(H100.nvlink_Bps * H100.comm_efficiency)
    # EP 16 over two nodes: 8 of 15 peers are remote, and the network is 9x slower than NVLink.
    assert _effective_bandwidth(16, H100) == pytest.approx(H100.comm_efficiency * H100.network_Bps * 15 / 8)


def test_all_to_all_bytes_and_expert_flops_follow_the_shape():
    costs, _ = costs_from_model(QWEN3_30B_A3B, Layout(gpus=16, ep=16, global_batch=1024), H100)
    layer = costs.layers[0]
    tokens = 4096
    assert layer.dispatch_bytes == layer.combine_bytes == tokens * 8 * 2048 * 2 * 15 / 16
    expert_flops = 2 * tokens * 8 * 2048 * 768 * 3
    assert layer.f_exp == pytest.approx(expert_flops / (H100.peak_flops * H100.compute_efficiency))
    assert layer.b_exp == pytest.approx(2 * layer.f_exp)
    assert len(costs.layers) == 48


def test_dense_layers_have_no_all_to_all():
    costs, _ = costs_from_model(SHAPES["deepseek-v3"], Layout(gpus=64, ep=64, global_batch=1024), H100)
    assert [layer.dispatch_bytes == 0 for layer in costs.layers[:4]] == [True, True, True, False]


def test_microbatches_per_rank_come_from_the_global_batch():
    assert Layout(gpus=16, ep=16, global_batch=1024).num_microbatches == 64
    assert Layout(gpus=2048, ep=16, global_batch=1024).num_microbatches == 1
