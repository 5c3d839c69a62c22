"""The planner: exact answers on synthetic costs, the engine's own launch order, costs read from records."""

from datetime import timedelta

import pytest

from ep_overlap_lab.engine import EPOverlapEngine
from ep_overlap_lab.moe_gpt import MoEGPTModel
from ep_overlap_lab.planner import (
    LayerCosts,
    Link,
    StepCosts,
    best_choice,
    costs_from_records,
    predict,
    simulate,
)
from megatron.bridge.training.ep_overlap import EPOverlapOptions

from .local_ranks import init_ep_groups, run_local_ranks
from .workers import Case, batches


def balanced(layers: int, c: float = 1.0, head: float = 0.0) -> tuple[StepCosts, Link]:
    """Every compute segment and every all-to-all takes c seconds (1 GB/s link, no latency)."""
    layer = LayerCosts(c, c, c, c, dispatch_bytes=c * 1e9, combine_bytes=c * 1e9)
    return StepCosts(layers=(layer,) * layers, f_tail=head, b_head=head), Link(1e9)


@pytest.mark.parametrize("layers", [1, 2, 3])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_comm_equal_to_compute_per_window_hides_exactly_the_pairing_bound(layers, n):
    costs, link = balanced(layers)
    comparison = predict(costs, link, n)
    assert comparison.baseline.step_s == 8 * layers * n  # everything serial
    assert comparison.overlap.step_s == 4 * layers * (n + 1)  # only F(0) and B(N-1) expose their comm
    assert comparison.h == (n - 1) / n
    assert comparison.overlap.exposed_s.get("paired", 0) == 0
    assert comparison.overlap.exposed_s["warmup"] == comparison.overlap.exposed_s["cooldown"] == 2 * layers


@pytest.mark.parametrize("layers", [1, 2, 3])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_edge_pairing_hides_what_the_unpaired_ends_exposed(layers, n):
    costs, link = balanced(layers)
    alone, edges = predict(costs, link, n), predict(costs, link, n, EPOverlapOptions(edge_pairing=True))
    assert edges.overlap.step_s < alone.overlap.step_s
    assert edges.h > (n - 1) / n  # past the bound that one microbatch alone at each end sets
    for phase in ("warmup", "cooldown"):
        assert edges.overlap.exposed_s[phase] < alone.overlap.exposed_s[phase]
    assert edges.overlap.exposed_s.get("paired", 0) == 0


@pytest.mark.parametrize("layers", [1, 2, 3])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_chunking_hides_most_of_what_the_unpaired_ends_exposed(layers, n):
    costs, link = balanced(layers)
    alone, chunked = predict(costs, link, n), predict(costs, link, n, EPOverlapOptions(moe_ep_overlap_chunks=2))
    assert chunked.baseline.step_s == alone.baseline.step_s  # the plain path does not chunk
    # Each half hides the other's all-to-alls; only the second half's last one at each end (half of one
    # microbatch's, 0.5 s) is left, where a microbatch alone exposed all of its 2 per layer.
    assert chunked.overlap.exposed_s["warmup"] == 0.5
    assert alone.overlap.exposed_s.get("warmup", alone.overlap.exposed_s.get("cooldown")) == 2 * layers
    assert chunked.h > (n - 1) / n
    assert chunked.overlap.exposed_s.get("paired", 0) <= alone.overlap.exposed_s.get("paired", 0)


def test_one_microbatch_hides_nothing():
    costs, link = balanced(2, head=0.5)
    comparison = predict(costs, link, 1)
    assert comparison.overlap.step_s == comparison.baseline.step_s and comparison.h == 0


def test_a_slow_link_bounds_the_step_by_comm():
    layer = LayerCosts(1, 1, 1, 1, dispatch_bytes=4e9, combine_bytes=4e9)  # 4 s per all-to-all
    costs = StepCosts(layers=(layer,), f_tail=0, b_head=0)
    overlapped = simulate(costs, Link(1e9), 16, EPOverlapOptions())
    assert overlapped.step_s >= 16 * 16  # the link carries 16 s per microbatch whatever the schedule
    assert overlapped.step_s < simulate(costs, Link(1e9), 16, EPOverlapOptions(overlap=False)).step_s


def test_delayed_wgrad_fills_the_dispatch_backward_window():
    # Window 3 (dispatch backward) has no compute of its own unless the expert wgrad moves there (no attention
    # wgrad here: only the expert wgrad moves).
    layer = LayerCosts(
        f_pre=1, f_exp=0.2, b_exp=2, b_pre=1, dispatch_bytes=2e9, combine_bytes=1e9, attention_wgrad_share=0.0
    )
    costs = StepCosts(layers=(layer, layer), f_tail=0, b_head=0)
    plain, delayed = predict(costs, Link(1e9), 8), predict(costs, Link(1e9), 8, EPOverlapOptions(delay_wgrad=True))
    assert delayed.overlap.step_s < plain.overlap.step_s
    assert best_choice(costs, Link(1e9), [4, 8])[0].delay_wgrad is True


def test_attention_wgrad_goes_where_the_window_is_comm_bound():
    # Window 2 (F.dispatch) has 2 s of comm beside 0.2 s of B.experts dgrad; window 1 is balanced.
    layer = LayerCosts(f_pre=1, f_exp=1, b_exp=0.4, b_pre=2, dispatch_bytes=2e9, combine_bytes=1e9)
    costs = StepCosts(layers=(layer, layer), f_tail=0, b_head=0)
    window1, window2 = (
        predict(costs, Link(1e9), 8, EPOverlapOptions(delay_wgrad=True, attention_wgrad_window=w)) for w in (1, 2)
    )
    assert window2.overlap.step_s < window1.overlap.step_s
    best = best_choice(costs, Link(1e9), [8])[0]
    assert (best.delay_wgrad, best.wgrad_window) == (True, 2)


def test_split_sizes_waited_for_off_the_host_stop_no_paired_step():
    # A 0.5 s split-size round trip before a 0.5 s dispatch, beside 1 s of B's expert backward: on the host the
    # round trip stops every paired layer step; off the host it fits under that compute.
    layer = LayerCosts(1, 1, 1, 1, dispatch_bytes=0.5e9, combine_bytes=0.5e9)
    costs, link = StepCosts(layers=(layer, layer), f_tail=0, b_head=0), Link(1e9, meta_s=0.5)
    on_host, off_host = predict(costs, link, 8), predict(costs, link, 8, EPOverlapOptions(launch_off_host=True))
    assert off_host.baseline.step_s == on_host.baseline.step_s  # the plain path waits on the host either way
    assert on_host.overlap.exposed_s["paired"] == pytest.approx(0.5 * 2 * 7)
    assert off_host.overlap.exposed_s["paired"] == 0
    assert off_host.overlap.launches == on_host.overlap.launches


ENDS = {"alone": {}, "edges": {"edge_pairing": True}, "chunks": {"moe_ep_overlap_chunks": 2}}


def _launch_order(rank: int, world: int, case: Case, ends: str) -> list[tuple[str, int, int]]:
    groups = init_ep_groups(case.ep, timedelta(seconds=30))
    model = MoEGPTModel(case.config(), groups)
    engine = EPOverlapEngine(model, groups, overlap=True, delay_wgrad=True, **ENDS[ends])
    recorder = engine.step(batches(case, rank, 0)).recorder
    return [(r.op, r.layer, r.microbatch) for r in recorder.comm if r.op != "split_exchange"]


@pytest.mark.parametrize("ends", sorted(ENDS))
@pytest.mark.parametrize("layer_freq", [(1, 1), (1, 0, 1)])
def test_the_simulated_schedule_launches_what_the_engine_launches_in_the_same_order(layer_freq, ends):
    case = Case(layer_freq=layer_freq, microbatches=3)
    engine_order = run_local_ranks(_launch_order, 2, (case, ends))[0].result
    moe = LayerCosts(1, 1, 1, 1, dispatch_bytes=1, combine_bytes=1)
    dense = LayerCosts(1, 1, 1, 1)
    costs = StepCosts(layers=tuple(moe if f else dense for f in layer_freq), f_tail=1, b_head=1)
    for window in (1, 2):
        options = EPOverlapOptions(delay_wgrad=True, attention_wgrad_window=window, **ENDS[ends])
        assert simulate(costs, Link(1e9), 3, options).launches == engine_order


def _record(node_or_op: str, layer: int, mb: int, start: float, end: float, *, comm: bool = False) -> dict:
    record = {"layer": layer, "microbatch": mb, "phase": "plain", "start_s": start, "end_s": end}
    if comm:
        return {**record, "op": node_or_op, "bytes_sent": 1000, "bytes_received": 1200}
    return {**record, "node": node_or_op}


def test_costs_are_read_from_the_plain_paths_segments():
    # One MoE layer between two dense ones (layer 1), two microbatches of identical shape.
    step = {"compute": [], "comm": []}
    for mb in range(2):
        t = 16.125 * mb
        spans = [
            ("plain split_exchange", 1, 0.75), ("split_exchange", 1, 0.125), ("plain dispatch", 1, 0.25),
            ("dispatch", 1, 0.5), ("plain combine", 1, 2.0), ("combine", 1, 0.5),
            ("plain forward_end", -1, 3.0), ("plain combine_bwd", 1, 1.5), ("combine_bwd", 1, 0.5),
            ("plain dispatch_bwd", 1, 4.0), ("dispatch_bwd", 1, 0.5), ("plain backward_end", -1, 2.5),
        ]  # fmt: skip
        for name, layer, seconds in spans:
            is_comm = not name.startswith("plain")
            step["comm" if is_comm else "compute"].append(_record(name, layer, mb, t, t + seconds, comm=is_comm))
            t += seconds
    costs, link = costs_from_records([step, step], [32.75, 32.75], link_gbps=3.2e-5, num_layers=3)  # 4000 B/s
    assert costs.layers[0] == costs.layers[2] == LayerCosts(0.0, 0.0, 0.0, 0.0)
    moe = costs.layers[1]
    assert (moe.f_pre, moe.f_exp, moe.b_exp, moe.b_pre) == (1.0, 2.0, 4.0, 2.5)
    assert (moe.dispatch_bytes, moe.combine_bytes) == (1200, 1200)
    assert (costs.f_tail, costs.b_head, costs.other_s) == (3.0, 1.5, 0.5)
    assert link.bandwidth_Bps == pytest.approx(4000)
    assert link.latency_s == pytest.approx(0.5 - 1200 / 4000)  # what the 0.5 s all-to-alls took beyond the bytes
    assert link.meta_s == 0.125  # the split-size round trip, recorded on its own


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "deepseek-v3"])
def test_published_shapes_activation_peak_is_reached_by_the_second_microbatch(model):
    # What lets the table count 4 microbatches for any N; and what each option holds at PP = 1: a paired step
    # holds F's finished layers and B's unfinished ones, about one microbatch's stack, so overlap and delayed wgrad
    # add less than one layer's bytes to the plain path's peak (its first forward and head); edge pairing holds a
    # second forward.
    from ep_overlap_lab.planner.cost_model import SHAPES, Layout, activation_shape
    from ep_overlap_lab.planner.memory import predicted_peak

    shape = activation_shape(SHAPES[model], Layout(gpus=8, ep=8, global_batch=1024))
    options = {
        "plain": EPOverlapOptions(overlap=False),
        "overlap": EPOverlapOptions(overlap=True),
        "delayed": EPOverlapOptions(overlap=True, delay_wgrad=True),
        "edges": EPOverlapOptions(overlap=True, edge_pairing=True),
    }
    peaks = {}
    for name, option in options.items():
        peaks[name] = predicted_peak(shape, option, 4)
        assert predicted_peak(shape, option, 2) == peaks[name] == predicted_peak(shape, option, 12), name
    layer = sum(b for node in ("pre_dispatch", "experts", "combine") for _, b in shape.saved(node, -1, 1))
    assert peaks["plain"] <= peaks["overlap"] <= peaks["delayed"] < peaks["plain"] + layer
    assert peaks["edges"] > 1.9 * peaks["plain"]


def test_a_recomputed_forward_is_charged_to_its_backward_node_where_overlap_hides_it():
    # Qwen3 at EP 16 is comm-bound: the experts' recompute lands in their backward, beside F's dispatch, so the
    # overlapped step grows by less than the plain one (not by nothing: beside the all-to-all the compute runs on
    # fewer SMs); without recompute the costs are the same as before.
    from ep_overlap_lab.planner.cost_model import (
        PROFILES,
        QWEN3_30B_A3B,
        Layout,
        costs_from_model,
    )

    layout = Layout(gpus=16, ep=16, global_batch=1024)
    kept, link = costs_from_model(QWEN3_30B_A3B, layout, PROFILES["H100"])
    again, _ = costs_from_model(QWEN3_30B_A3B, layout, PROFILES["H100"], frozenset({"moe"}))
    assert kept == costs_from_model(QWEN3_30B_A3B, layout, PROFILES["H100"], frozenset())[0]
    moe = next(i for i, layer in enumerate(kept.layers) if layer.f_exp)
    assert again.layers[moe].b_exp == pytest.approx(kept.layers[moe].b_exp + kept.layers[moe].f_exp)
    n = layout.num_microbatches
    before, after = predict(kept, link, n), predict(again, link, n)
    plain_cost = after.baseline.step_s - before.baseline.step_s
    assert 0 < after.overlap.step_s - before.overlap.step_s < 0.9 * plain_cost


STEADY_OPTIONS = [
    EPOverlapOptions(overlap=False),
    EPOverlapOptions(overlap=True),
    EPOverlapOptions(overlap=True, delay_wgrad=True, attention_wgrad_window=2),
    EPOverlapOptions(overlap=True, edge_pairing=True),
    EPOverlapOptions(overlap=True, moe_ep_overlap_chunks=2),
]


@pytest.mark.parametrize("options", STEADY_OPTIONS, ids=str)
def test_a_long_step_priced_from_its_steady_state_equals_simulating_every_op(options):
    from ep_overlap_lab.planner import cost_model
    from ep_overlap_lab.planner.simulate import STEADY_FROM, _simulate_ops

    costs, link = cost_model.costs_from_model(
        cost_model.DEEPSEEK_V3, cost_model.Layout(64, 64, 2560), cost_model.PROFILES["H100"]
    )  # dense layers first, then MoE ones
    n = STEADY_FROM + 13
    steady, every_op = simulate(costs, link, n, options), _simulate_ops(costs, link, n, options)
    assert steady.steady_from == STEADY_FROM and every_op.steady_from is None
    for got, want in [(steady.step_s, every_op.step_s), (steady.comm_s, every_op.comm_s)]:
        assert got == pytest.approx(want, rel=1e-12)
    assert steady.exposed_s.keys() == every_op.exposed_s.keys()
    for phase, want in every_op.exposed_s.items():
        assert steady.exposed_s[phase] == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_a_step_of_a_million_microbatches_is_priced():
    costs, link = balanced(2)
    comparison = predict(costs, link, 2**20)  # op by op: tens of millions of ops
    assert comparison.baseline.step_s == pytest.approx(16 * 2**20)
    assert comparison.overlap.step_s == pytest.approx(8 * (2**20 + 1))  # the pairing bound, as for small counts


def test_costs_without_communication_are_refused_not_priced_as_dense():
    costs, link = balanced(2)
    silent = StepCosts(layers=tuple(LayerCosts(1.0, 1.0, 1.0, 1.0) for _ in costs.layers), f_tail=0.0, b_head=0.0)
    with pytest.raises(ValueError, match="no layer moves tokens between ranks"):
        predict(silent, link, 4)  # at EP 1 it predicted a speedup from the subtracted expert wgrad
