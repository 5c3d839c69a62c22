"""The planner against upstream's published matched A/Bs (the seed page, docs/performance/ep-overlap-planner.md):
one model, one calibrated figure (``dispatchers.COMM_STRETCH``), no constant per case."""

import pytest

from ep_overlap_lab.planner import predict
from ep_overlap_lab.planner.cost_model import PROFILES, QWEN3_30B_A3B, Dispatcher, Layout, costs_from_model
from ep_overlap_lab.planner.resources import Resources
from ep_overlap_lab.planner.simulate import Link
from megatron.bridge.training.ep_overlap.options import EPOverlapOptions

# Qwen3-30B-A3B, 16 x H100, EP 16, global batch 1,024 (64 microbatches of one 4,096-token sequence per rank).
LAYOUT = Layout(gpus=16, ep=16, global_batch=1024)
PUBLISHED = [
    # alltoall, no CUDA graphs: 41.25 s -> 31.31 s; with delayed wgrad 31.20 s
    (Dispatcher("alltoall"), False, 41.25 / 31.31),
    (Dispatcher("alltoall"), True, 41.25 / 31.20),
    # HybridEP as the perf recipe sets it (moe_hybridep_num_sms = 32): 24.71 s -> 20.99 s
    (Dispatcher("hybridep", num_sms=32), False, 24.71 / 20.99),
]


@pytest.mark.parametrize(
    ("dispatcher", "delay_wgrad", "measured"), PUBLISHED, ids=["alltoall", "alltoall+dw", "hybridep"]
)
def test_the_published_speedups_are_predicted_within_5_percent(dispatcher, delay_wgrad, measured):
    costs, link = costs_from_model(QWEN3_30B_A3B, LAYOUT, PROFILES["H100"], dispatcher=dispatcher)
    predicted = predict(costs, link, LAYOUT.num_microbatches, EPOverlapOptions(delay_wgrad=delay_wgrad)).speedup
    assert predicted == pytest.approx(measured, rel=0.05)


def test_a_transfer_and_the_compute_beside_it_slow_each_other():
    sim = Resources(Link(1.0, comm_stretch=2.0, compute_stretch=1.5), launch_off_host=False)
    sim.launch(("dispatch", 0, 0), 1.0)  # 1 s on the link alone
    sim.compute(1.0)  # 1.5 s beside it, in which the transfer sends 0.75 s of its bytes
    assert sim.host == pytest.approx(1.5)
    sim.wait_for(("dispatch", 0, 0))  # the rest alone
    assert sim.host == pytest.approx(1.75)
    assert sim.exposed[sim.phase] == pytest.approx(0.25)
    sim.compute(1.0)  # nothing on the link: at full speed
    assert sim.host == pytest.approx(2.75)
