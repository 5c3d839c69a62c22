"""Planner costs from a model shape: FLOPs and bytes scale as they should, links split by node."""

import math

import pytest

from ep_overlap_lab.planner.cost_model import (
    PROFILES,
    QWEN3_30B_A3B,
    SHAPES,
    Layout,
    costs_from_model,
)
from ep_overlap_lab.planner.dispatchers import Dispatcher, all_to_all_seconds, compute_stretch, copies_per_token

H100 = PROFILES["H100"]
FIGURES = ("peak_flops", "sm_count", "hbm_Bps", "gpus_per_node", "nvlink_Bps", "network_Bps")


def test_every_profile_figure_says_where_it_comes_from():
    assert {"H100", "H200", "B200", "GB200", "GB300"} <= PROFILES.keys()
    for profile in PROFILES.values():
        for figure in (*FIGURES, "compute_efficiency", "comm_efficiency", "latency_s"):
            assert profile.sources[figure]
        assert "assumption" in profile.sources["compute_efficiency"]
    assert {p.gpus_per_node for p in PROFILES.values()} == {8, 72}  # HGX boards and NVL72 racks


def test_ep_within_a_node_runs_on_nvlink_and_beyond_it_on_the_network():
    alltoall = Dispatcher()
    assert copies_per_token(alltoall, 128, 8, 8, 8) == (8 * 7 / 8, 0.0)
    # EP 16 over two nodes: of a token's 8 copies, 7/16 go to NVLink peers, 8/16 to the other node
    assert copies_per_token(alltoall, 128, 8, 16, 8) == (8 * 7 / 16, 8 * 8 / 16)
    seconds = all_to_all_seconds(alltoall, H100, 128, 8, 16, 4096, 2048)
    assert seconds == pytest.approx(4096 * 2048 * 2 * 4 / H100.network_Bps / H100.comm_efficiency)
    # one NVL72 domain holds all 64 ranks: nothing crosses the network
    assert copies_per_token(alltoall, 256, 8, 64, PROFILES["GB200"].gpus_per_node)[1] == 0


def test_hierarchical_dispatch_sends_a_token_across_the_network_once_per_remote_node():
    nvlink, network = copies_per_token(Dispatcher("hybridep"), 128, 8, 16, 8)
    assert network == pytest.approx(1 - math.comb(64, 8) / math.comb(128, 8))  # the other node, unless all 8 are local
    assert network < copies_per_token(Dispatcher("ncclep"), 128, 8, 16, 8)[1] < 4  # alltoall: 4 copies
    assert nvlink > 0


def test_the_sms_a_dispatcher_holds_slow_the_compute_beside_it():
    assert compute_stretch(Dispatcher("hybridep", num_sms=32), H100, 0.0) == pytest.approx(132 / 100)
    assert compute_stretch(Dispatcher("deepep"), H100, 0.0) == pytest.approx(132 / 112)  # DeepEP's default 20
    assert compute_stretch(Dispatcher("deepep"), H100, H100.hbm_Bps / 4) == pytest.approx(132 / 112 / 0.75)
    with pytest.raises(ValueError, match="static_shape"):
        Dispatcher("alltoall", static_shape=True)


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
