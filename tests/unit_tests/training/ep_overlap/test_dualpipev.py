"""DualPipeV's per-rank op list as data: its layout, its phases, its deadlock freedom and its bubble."""

import dataclasses
import itertools

import pytest

from ep_overlap_lab.program.dualpipev import Costs, published_bubble, simulate_dualpipev, simulate_schedules
from megatron.bridge.training.ep_overlap.program.dualpipev import dualpipev_schedule, stage_of
from megatron.bridge.training.ep_overlap.program.pipeline import Phase

SIZES = [(P, N) for P in (2, 4, 8) for N in range(2 * P, 4 * P + 2)]


def _units(steps, field):
    return [getattr(s, field) for s in steps if getattr(s, field) is not None]


@pytest.mark.parametrize("overlap", [True, False])
def test_every_stage_runs_each_microbatch_once_in_order_and_each_w_after_its_backward(overlap):
    for P, N in SIZES:
        for r in range(P):
            steps = dualpipev_schedule(P, N, r, overlap=overlap)
            for v in (0, 1):
                assert [m for m, u in _units(steps, "forward") if u == v] == list(range(N))
                assert [m for m, u in _units(steps, "backward") if u == v] == list(range(N))
            weights = _units(steps, "weight")
            assert len(weights) == len(set(weights)) == 2 * (P - r - 1) + r + 1
            backwards = _units(steps, "backward")
            assert weights == sorted(weights, key=backwards.index)  # W runs in the order its backwards queued
            phases = [s.phase for s in steps]
            assert phases[0] == Phase.WARMUP and phases[-1] == Phase.COOLDOWN
            assert phases.index(Phase.COOLDOWN) > max(i for i, p in enumerate(phases) if p == Phase.WARMUP)


def test_paired_steps_pair_the_two_stages_of_a_rank_and_only_with_overlap():
    for P, N in SIZES:
        for r in range(P):
            paired = [s for s in dualpipev_schedule(P, N, r) if s.paired]
            assert paired and all(s.forward[1] != s.backward[1] for s in paired)
            # DualPipeV's steady phase: 2 (N - 2P + r + 1) F&B, less the last rank's first, plus P - r - 1
            assert len(paired) == 2 * (N - 2 * P + r + 1) - (r == P - 1) + (P - r - 1)
            assert not any(s.paired for s in dualpipev_schedule(P, N, r, overlap=False))


def test_the_v_layout_puts_embedding_and_loss_on_rank_0_and_the_turn_on_the_last_rank():
    P = 4
    assert [(stage_of(r, 0, P), stage_of(r, 1, P)) for r in range(P)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    steps = dualpipev_schedule(P, 2 * P, 0)
    first_forward = next(s for s in steps if s.forward == (0, 0))
    assert not first_forward.recv  # the embedding's input is the data
    loss = next(s for s in steps if s.forward == (0, 1))
    assert not loss.send  # the loss ends the forward
    turn = [s for s in dualpipev_schedule(P, 2 * P, P - 1) if s.forward is not None]
    assert not [t for s in turn if s.forward[1] == 1 for t in s.recv]  # stage P takes stage P-1's output locally
    assert {t.peer for s in steps for t in s.recv + s.send} == {1}


@pytest.mark.parametrize("overlap", [True, False])
def test_the_simulator_finds_no_deadlock_for_p_2_4_8_and_n_from_2p(overlap):
    for P, N in SIZES:
        timeline = simulate_dualpipev(P, N, overlap=overlap)
        assert all(len(t) == len(s) for t, s in zip(timeline.times, timeline.steps))


def test_the_simulator_finds_a_cycle_of_receives_an_unmatched_transfer_and_work_out_of_order():
    P, N = 2, 4
    schedules = [dualpipev_schedule(P, N, r) for r in range(P)]
    # Rank 1's backward of stage 2 for microbatch 0 moved before every forward: it waits for a gradient from rank 0,
    # whose loss needs the activation rank 1 has not sent yet.
    swapped = [step for step in schedules[1] if step.backward == (0, 1)]
    with pytest.raises(RuntimeError, match="deadlocks: rank 0 at step .* waits for"):
        simulate_schedules([schedules[0], swapped + [s for s in schedules[1] if s not in swapped]])
    dropped = [dataclasses.replace(s, send=()) if s.forward == (0, 0) else s for s in schedules[0]]
    with pytest.raises(RuntimeError, match="unmatched transfers"):
        simulate_schedules([dropped, schedules[1]])
    early_w = [s for s in schedules[1] if s.weight is not None][:1]
    with pytest.raises(RuntimeError, match="W of .* before its backward"):
        simulate_schedules([schedules[0], early_w + [s for s in schedules[1] if s not in early_w]])


def test_the_bubble_is_dualpipes_published_formula():
    """(PP/2 - 1)(F&B + B - 3W) with PP = 2P stages, for F = W and B = 2F (the zero-bubble papers' unit costs)
    and any F&B between B and F + B: the worst rank's idle time in the step's span."""
    for (P, N), forward, paired in itertools.product(SIZES, (1.0, 3.0), (2.0, 2.5, 3.0)):
        costs = Costs(forward=forward, backward=2 * forward, weight=forward, paired=paired * forward)
        timeline = simulate_dualpipev(P, N, costs=costs)
        assert max(timeline.bubbles) == published_bubble(P, costs) == (P - 1) * (paired - 1) * forward


def test_it_holds_2p_plus_1_stage_activations_per_rank():
    for P, N in SIZES:
        assert simulate_dualpipev(P, N).in_flight == [2 * P + 1] * P  # DualPipe's PP + 1, PP = 2P stages


def test_too_few_microbatches_or_stages_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"num_microbatches >= 2 x pipeline_model_parallel_size = 8 \(got 7\); fix"):
        dualpipev_schedule(4, 7, 0)
    with pytest.raises(ValueError, match="pipeline_model_parallel_size >= 2"):
        dualpipev_schedule(1, 4, 0)


# ---- the planner's price of DualPipeV beside 1F1B and interleaved 1F1B -------------------------------------------


def test_the_planner_prices_each_schedule_with_its_published_bubble():
    from ep_overlap_lab.planner.dualpipev import SCHEDULES, LayerCosts, pick, price

    layer = LayerCosts(forward_s=1.0, backward_s=2.0, weight_s=1.0, paired_s=2.5, boundary_bytes=1000)
    for P, N in ((2, 4), (4, 8), (4, 13), (8, 16)):
        L = 8 * P
        plain = price("1f1b", L, P, N, layer, overlap=False)
        assert plain.bubble_s == (P - 1) * (1.0 + 2.0) * L / P  # (PP - 1)(F + B), a stage of L / P layers
        assert plain.held_layers == P * L // P  # 1F1B's PP microbatches on the first stage
        prices = [price(s, L, P, N, layer) for s in SCHEDULES]
        dualpipev = prices[-1]
        chunk = Costs(*(x * L / (2 * P) for x in (1.0, 2.0, 1.0, 2.5)))
        assert dualpipev.bubble_s == published_bubble(P, chunk)
        assert dualpipev.held_layers == (2 * P + 1) * L // (2 * P)  # PP + 1 stages' activations
        assert pick(prices) is dualpipev and dualpipev.step_s < min(p.step_s for p in prices[:-1])
        # a middle rank sends each microbatch's activation and gradient out of both its stages; an end rank half
        assert dualpipev.p2p_bytes == (2 if P == 2 else 4) * N * 1000


def test_the_planner_says_why_a_schedule_cannot_run():
    from ep_overlap_lab.planner.dualpipev import LayerCosts, format_prices, pick, price

    layer = LayerCosts(1.0, 2.0, 1.0, 2.5)
    few = price("dualpipev", 8, 2, 3, layer)
    assert few.problem.startswith("DualPipeV needs num_microbatches >= 2 x pipeline_model_parallel_size = 4 (got 3)")
    uneven = price("interleaved", 6, 2, 4, layer)
    assert uneven.problem == "6 layers do not split into 4 equal stages; fix: choose another schedule or PP"
    one_f1b = price("1f1b", 6, 2, 3, layer)
    assert pick([few, uneven, one_f1b]) is one_f1b
    assert "dualpipev    cannot run: DualPipeV needs" in format_prices([few, one_f1b])
    with pytest.raises(ValueError, match="no schedule runs: dualpipev: DualPipeV needs"):
        pick([few])


def test_the_documented_timeline_is_the_simulated_one():
    from pathlib import Path

    from ep_overlap_lab.program.dualpipev import draw_timeline

    doc = (Path(__file__).resolve().parents[4] / "docs/training/ep-overlap-schedule.md").read_text()
    drawn = doc.split("**The timeline.**", 1)[1].split("```\n", 2)[1].rstrip("\n")
    assert drawn == draw_timeline(simulate_dualpipev(4, 8, costs=Costs(1, 2, 1, 2)), 3)
    assert "rank 3  .........|F0|f0|F1" in drawn  # the last rank waits three units for its first activation
