"""The planner's pipelines: the classic 1F1B time without communication, PP = 1 as the one-rank simulation, the
microbatches in flight per stage, and the overlap's price in memory (the engine's count: test_saved_activations)."""

import pytest

from ep_overlap_lab.planner import (
    LayerCosts,
    Link,
    StepCosts,
    in_flight,
    simulate,
    simulate_pipeline,
)
from megatron.bridge.training.ep_overlap.options import EPOverlapOptions

PLAIN, OVERLAP = EPOverlapOptions(overlap=False), EPOverlapOptions()
LINK = Link(1e9, latency_s=1e-3)


def _costs(layers: int, nbytes: float, head: float = 0.0) -> StepCosts:
    layer = LayerCosts(f_pre=1.0, f_exp=1.0, b_exp=2.0, b_pre=2.0, dispatch_bytes=nbytes, combine_bytes=nbytes)
    return StepCosts(layers=(layer,) * layers, f_tail=head, b_head=head)


@pytest.mark.parametrize("P, N", [(2, 1), (2, 5), (4, 3), (4, 9)])
def test_plain_1f1b_without_communication_takes_n_plus_p_minus_1_stage_steps(P, N):
    costs = _costs(8, 0.0)
    forward, backward = 2.0 * 8 / P, 4.0 * 8 / P  # one stage's share of a microbatch
    priced = simulate_pipeline(costs, Link(1e9), N, PLAIN, pipeline_size=P)  # P2P of no bytes and no latency
    assert priced.step_s == pytest.approx((N + P - 1) * (forward + backward))
    # the first stage waits for the others to fill and drain the pipeline: P - 1 stage steps
    assert priced.bubble_s[0] == pytest.approx((P - 1) * (forward + backward))
    slower = simulate_pipeline(costs, Link(1e9), N, PLAIN, pipeline_size=P, p2p=Link(1e9, latency_s=0.1))
    assert slower.step_s > priced.step_s  # a P2P that takes time adds to the step


@pytest.mark.parametrize(
    "options", [PLAIN, OVERLAP, EPOverlapOptions(delay_wgrad=True)], ids=["plain", "on", "delayed"]
)
def test_one_stage_is_the_one_rank_simulation(options):
    costs = _costs(4, 1e9, head=0.5)
    for n in (1, 2, 7):
        assert (
            simulate_pipeline(costs, LINK, n, options, pipeline_size=1).step_s
            == simulate(costs, LINK, n, options).step_s
        )


def test_overlap_pays_in_the_plain_1f1b_pipeline_where_communication_is_exposed():
    costs = _costs(4, 1e9, head=0.5)
    plain = simulate_pipeline(costs, LINK, 8, PLAIN, pipeline_size=2, p2p_bytes=1e6)
    over = simulate_pipeline(costs, LINK, 8, OVERLAP, pipeline_size=2, p2p_bytes=1e6)
    assert over.step_s < plain.step_s
    assert over.exposed_total_s < plain.exposed_total_s


@pytest.mark.parametrize("P", [2, 3, 4])
def test_in_flight_is_p_minus_r_for_1f1b_and_twice_that_with_the_overlap(P):
    N = 4 * P
    assert [in_flight(P, 1, N, r, overlap=False) for r in range(P)] == [P - r for r in range(P)]
    assert [in_flight(P, 1, N, r, overlap=True) for r in range(P)] == [2 * (P - r) for r in range(P)]
    # too few microbatches to fill a stage: it holds all of them
    assert in_flight(P, 1, 2, 0, overlap=True) == 2


def test_layers_that_do_not_split_over_the_stages_are_refused():
    with pytest.raises(ValueError, match="do not divide|not divisible"):
        simulate_pipeline(_costs(5, 1e9), LINK, 4, OVERLAP, pipeline_size=2)
    with pytest.raises(ValueError, match="full recompute at PP = 1 only"):
        simulate_pipeline(StepCosts(layers=_costs(4, 1e9).layers, f_tail=0, b_head=0, segments=((0, 1),)), LINK, 4,
                          OVERLAP, pipeline_size=2)  # fmt: skip
