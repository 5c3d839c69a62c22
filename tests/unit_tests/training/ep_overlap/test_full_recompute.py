"""Full activation recompute inside the overlapped schedule: no number changes, the replay is in the program.

Each case trains the reference model with ``recompute_granularity="full"`` on every arm of ``workers.train_arms``
(plain path, overlap, delayed wgrad, edge pairing, chunks) and compares every loss, gradient, final parameter and
expert bias, bit for bit, with the plain path keeping everything.
"""

import contextlib
import io
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ep_overlap_lab.engine import EPOverlapEngine
from ep_overlap_lab.moe_gpt import MoEGPTModel
from ep_overlap_lab.moe_gpt.token_dispatcher import Routing, replay_splits

from .bitwise import assert_bitwise, assert_same_training
from .local_ranks import run_local_ranks
from .test_numerics import EXPERT_BIAS, ROUTER_LOSSES_AND_SHARED
from .test_pipeline import PIPELINE_ARMS, PipeCase, assert_matches_reference, train_layout
from .test_saved_activations import OPTIONS, _config, _measured_and_planned
from .workers import Case, train_arms


def full(method: str = "uniform", layers: int = 1) -> dict:
    return {"recompute_granularity": "full", "recompute_method": method, "recompute_num_layers": layers}


# delayed_auto: EPOverlapEngine's planner places the attention wgrad from a measured plain step that replayed
ARMS = ("plain", "overlap", "delayed", "delayed_edges", "delayed_auto")
CASES = {
    "fp32-uniform1": Case(arms=ARMS, extra=full()),
    "bf16-uniform1-router-losses-shared": Case(bf16=True, arms=ARMS, extra={**full(), **ROUTER_LOSSES_AND_SHARED}),
    "fp32-uniform2-expert-bias": Case(arms=ARMS, extra={**full("uniform", 2), **EXPERT_BIAS}),
    "fp32-block1-window2": Case(arms=ARMS + ("delayed_window2",), extra=full("block", 1)),
    # Chunked unpaired phases: bitwise the plain path over the halves (chunking's own bound), recomputing or not.
    "fp32-uniform1-chunks": Case(arms=("plain_units", "delayed_chunks"), extra=full()),
}


def _kept(case: Case) -> Case:
    """The same case keeping every activation, on its plain arm."""
    extra = {k: v for k, v in case.extra.items() if not k.startswith("recompute")}
    return replace(case, arms=(case.arms[0],), extra=extra)


def _both(rank: int, world: int, case: Case) -> dict:
    return {"kept": train_arms(rank, world, _kept(case))[case.arms[0]], **train_arms(rank, world, case)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_full_recompute_changes_no_number(name):
    case = CASES[name]
    for outcome in run_local_ranks(_both, case.world, (case,)):
        runs = outcome.result
        for arm in case.arms:
            where = f"rank {outcome.rank} {arm} {name}"
            assert_same_training(runs["kept"], runs[arm], case.steps, where)
            for bias, value in runs["kept"]["biases"].items():
                assert_bitwise(value, runs[arm]["biases"][bias], f"{where} {bias}")
            if arm != case.arms[0]:  # the overlapped arms replayed: their replay all-to-alls ran on the lane
                assert {"replay_dispatch", "replay_combine"} <= {r["op"] for r in runs[arm]["comm"]}, arm


PIPE_CASES = {
    "pp2-vpp2-uniform1-N4": PipeCase(microbatches=4, extra=full()),
    # A two-layer segment in a chunk that pairs with shorter ones: replayed inside paired and unpaired steps.
    "pp2-vpp2-uniform2-unequal-chunks-N4": PipeCase(
        layer_freq=(1, 1, 0, 1, 1, 0),
        first_stage=2,
        last_stage=4,
        custom_chunks=((0,), (1, 2), (3, 4), (5,)),
        microbatches=4,
        extra=full("uniform", 2),
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", sorted(PIPE_CASES))
def test_pipelined_full_recompute_is_bitwise_pp1_keeping_everything(name):
    case = PIPE_CASES[name]
    kept = replace(case, extra={k: v for k, v in case.extra.items() if not k.startswith("recompute")})
    reference = {
        o.result["data_rank"]: o.result["plain"] for o in run_local_ranks(train_layout, 2, (kept, 1, 1, ("plain",)))
    }
    for outcome in run_local_ranks(train_layout, 4, (case, 2, 2, PIPELINE_ARMS)):
        for arm in PIPELINE_ARMS:
            where = f"rank {outcome.rank} {arm}"
            assert_matches_reference(reference[outcome.result["data_rank"]], outcome.result[arm], case.steps, where)


MEMORY_CASES = {
    "fp32-uniform1": {**full()},
    "bf16-rmsnorm-swiglu-uniform2": {**full("uniform", 2), "normalization": "RMSNorm", "bf16": True,
                                     "gated_linear_unit": True},
    "fp32-block1-aux-z-loss": {**full("block", 1), "moe_router_load_balancing_type": "aux_loss",
                               "moe_aux_loss_coeff": 0.1, "moe_z_loss_coeff": 0.01},
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(MEMORY_CASES))
def test_the_planner_counts_what_a_recomputed_segment_holds_exactly(name):
    """Forward keeps each segment's input, the replay what the forward would have saved: the planner's walk of the
    program (planner/memory.py) against the engine's count (engine/saved.py), byte for byte, every schedule option;
    and recomputing holds less than keeping everything."""
    config = _config(**MEMORY_CASES[name])
    kept = _config(**{k: v for k, v in MEMORY_CASES[name].items() if not k.startswith("recompute")})
    # every option the rules let run with these segments ('uniform' places the attention wgrad itself)
    options = {k: v for k, v in OPTIONS.items() if config.recompute_method == "block" or k != "delayed-window2"}
    full_runs = run_local_ranks(_measured_and_planned, 2, (config, 4, options))
    kept_runs = run_local_ranks(_measured_and_planned, 2, (kept, 4, options))
    for outcome, kept_outcome in zip(full_runs, kept_runs):
        for option, (measured, planned) in outcome.result.items():
            assert planned == measured, f"rank {outcome.rank} {option}: planned {planned}, measured {measured}"
            assert measured < kept_outcome.result[option][0], option


def _doc_snippet(rank: int, world: int) -> dict:
    """The full-recompute snippet of ep-overlap-schedule.md, run as written, then one step beside the same model
    keeping everything."""
    doc = (Path(__file__).resolve().parents[4] / "docs/training/ep-overlap-schedule.md").read_text()
    snippet = re.search(r"### Full recompute[^\n]*\n.*?```python\n(.*?)```", doc, re.S).group(1)
    namespace: dict = {}
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        exec(snippet, namespace)
    engine, config, groups = namespace["engine"], namespace["config"], namespace["groups"]
    data = [(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))) for _ in range(4)]
    kept = replace(config, recompute_granularity=None, recompute_method=None, recompute_num_layers=None)
    plain = EPOverlapEngine(MoEGPTModel(kept, groups), groups, overlap=False)
    return {
        "printed": printed.getvalue(),
        "losses": [engine.step(data).losses, plain.step(data).losses],
        "grads": [[p.grad for p in m.parameters()] for m in (namespace["model"], plain.model)],
    }


def test_the_full_recompute_snippet_runs_as_written():
    for outcome in run_local_ranks(_doc_snippet, 2, ()):
        result = outcome.result
        printed = result["printed"].splitlines()
        assert printed[:3] == ["compute replay_input u0 L1", "compute replay_pre_dispatch u0 L1",
                               "launch replay_dispatch u0 L1"], printed  # fmt: skip
        for a, b in zip(*result["losses"]):
            assert_bitwise(a, b, f"rank {outcome.rank} loss")
        for a, b in zip(*result["grads"]):
            assert_bitwise(a, b, f"rank {outcome.rank} grad")


def test_a_replayed_router_that_routes_otherwise_is_caught_naming_the_layer():
    """The replay reuses the first forward's split sizes instead of exchanging them again; other counts would move
    rows of the wrong size, so they fail the replay (an expert bias moved between the two forwards, say)."""
    experts_TK = torch.tensor([[0, 1], [1, 2], [3, 0]])
    first = Routing.build(experts_TK, num_experts=4, ep_size=2)
    replay_splits(first, ([[2, 2], [1, 1]], [[2, 2], [1, 1]]), where="layer3")  # its own counts: completes it
    assert (first.in_splits, first.out_splits, first.local_group_sizes) == ([4, 2], [4, 2], [3, 3])
    moved = Routing.build(torch.tensor([[0, 1], [1, 2], [3, 3]]), num_experts=4, ep_size=2)
    with pytest.raises(RuntimeError, match=r"layer3: the replayed router sends \[\[1, 2\], \[1, 2\]\] tokens"):
        replay_splits(moved, first.exchanged, where="layer3")


def test_measured_costs_take_the_plain_paths_replay_off_the_backward():
    """The plain path with full recompute replays layer 0's forward inside the backward from layer 1 down: its
    records name that replay (``plain replay_*``), and the planner counts it as forward, not as layer 1's backward."""
    from ep_overlap_lab.planner import costs_from_records

    t = iter(range(100))

    def compute(node: str, layer: int, seconds: float) -> dict:
        start = next(t)
        return {"node": f"plain {node}", "layer": layer, "start_s": start, "end_s": start + seconds}

    def comm(op: str, layer: int) -> dict:
        start = next(t)
        return {"op": op, "layer": layer, "start_s": start, "end_s": start + 0.1, "bytes_sent": 8, "bytes_received": 8}

    forward = [compute("split_exchange", 0, 1.0), compute("dispatch", 0, 0.5), compute("combine", 0, 2.0)]
    # From the head's backward down: layer 1's part (2.0), then layer 0's replay (1.5), its combine backward
    backward = [compute("replay_split_exchange", 0, 3.0), compute("replay_dispatch", 0, 0.5)]
    backward += [compute("replay_combine", 0, 2.0), compute("combine_bwd", 0, 0.25), compute("dispatch_bwd", 0, 4.0)]
    ops = [comm(op, 0) for op in ("dispatch", "combine", "replay_dispatch", "replay_combine", "combine_bwd")]
    costs, _ = costs_from_records([{"compute": forward + backward, "comm": ops}], [200.0], None, 2, ((0, 1),))
    layer0 = costs.layers[0]
    assert (layer0.f_pre, layer0.f_exp, layer0.b_exp) == (1.5, 2.0, 4.0)
    assert costs.b_head == 0.25 + 2.0  # what ran from the head down to layer 0's combine backward, less the replay
    assert costs.segments == ((0, 1),)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_planner_charges_each_replay_its_forward_and_its_all_to_alls(overlap):
    from ep_overlap_lab.planner.simulate import LayerCosts, Link, StepCosts, simulate
    from megatron.bridge.training.ep_overlap.options import EPOverlapOptions

    layer = LayerCosts(f_pre=1.0, f_exp=2.0, b_exp=4.0, b_pre=3.0, dispatch_bytes=5.0, combine_bytes=7.0)
    kept = StepCosts(layers=(layer, layer), f_tail=0.5, b_head=1.0)
    options = EPOverlapOptions(overlap=overlap)
    link = Link(bandwidth_Bps=10.0)
    before = simulate(kept, link, 4, options)
    after = simulate(replace(kept, segments=((0, 1), (1, 2))), link, 4, options)
    # Every layer of every microbatch runs its forward once more, and its dispatch and combine once more.
    assert after.compute_s == pytest.approx(before.compute_s + 4 * 2 * (1.0 + 2.0))
    assert after.comm_s == pytest.approx(before.comm_s + 4 * 2 * (5.0 + 7.0) / 10.0)
    replays = [key for key in after.launches if key[0].startswith("replay_")]
    assert len(replays) == 4 * 2 * 2 and ("replay_dispatch", 1, 0) in replays
