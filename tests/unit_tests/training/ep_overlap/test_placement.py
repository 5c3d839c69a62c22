"""The engine's own placement of the delayed attention wgrad (``attention_wgrad_window=None``)."""

from datetime import timedelta
from types import SimpleNamespace

import pytest

from ep_overlap_lab.engine import EPOverlapEngine, ep_overlap_engine
from ep_overlap_lab.moe_gpt import MoEGPTModel
from ep_overlap_lab.planner import LayerCosts, Link, StepCosts, step_by_wgrad_window
from megatron.bridge.training.ep_overlap import EPOverlapOptions
from megatron.bridge.training.ep_overlap.settings import resolve

from .local_ranks import init_ep_groups, run_local_ranks
from .workers import Case, batches


def test_the_planner_prefers_the_window_beside_the_comm_bound_dispatch():
    # Window 2 (F.dispatch) has 2 s of comm beside 0.4 s of B.experts dgrad; window 1 is balanced.
    layer = LayerCosts(f_pre=1, f_exp=1, b_exp=0.4, b_pre=2, dispatch_bytes=2e9, combine_bytes=1e9)
    steps = step_by_wgrad_window(
        StepCosts(layers=(layer, layer), f_tail=0, b_head=0), Link(1e9), 8, EPOverlapOptions()
    )
    assert steps[2] < steps[1]


def _auto(rank: int, world: int, delay_wgrad: bool) -> dict:
    groups = init_ep_groups(2, timedelta(seconds=30))
    case = Case(layer_freq=(1, 1))
    engine = EPOverlapEngine(
        MoEGPTModel(case.config(), groups, seed=7),
        groups,
        overlap=True,
        delay_wgrad=delay_wgrad,
        attention_wgrad_window=None,
    )
    phases = []
    for step in range(3):
        recorder = engine.step(batches(case, rank, step)).recorder
        phases.append({r.phase for r in recorder.comm})
    return {"placement": engine.placement, "window": engine.attention_wgrad_window, "phases": phases}


def test_the_first_step_measures_then_every_rank_runs_the_same_planned_window():
    outcomes = run_local_ranks(_auto, 2, (True,))
    placements = [o.result["placement"] for o in outcomes]
    assert placements[0] == placements[1], "ranks must agree"
    placement = placements[0]
    assert set(placement.predicted_step_s) == {1, 2}
    assert placement.window == min(placement.predicted_step_s, key=lambda w: (placement.predicted_step_s[w], w))
    assert f"attention wgrad in window {placement.window} (auto" in placement.describe()
    for outcome in outcomes:
        assert outcome.result["window"] == placement.window
        first, *later = outcome.result["phases"]
        assert first == {"plain"}  # the measured step ran the plain path
        assert all(phases == {"warmup", "paired", "cooldown"} for phases in later)


def test_without_delayed_wgrad_there_is_nothing_to_place():
    for outcome in run_local_ranks(_auto, 2, (False,)):
        assert outcome.result["placement"] is None and outcome.result["window"] == 1
        assert all(phases == {"warmup", "paired", "cooldown"} for phases in outcome.result["phases"])


def _chunk(pipeline: int = 1) -> SimpleNamespace:
    """A model chunk as far as the rules read it: its config (the engine checks the rules before the model)."""
    config = SimpleNamespace(
        expert_model_parallel_size=2, num_moe_experts=4, moe_token_dispatcher_type="alltoall",
        pipeline_model_parallel_size=pipeline, virtual_pipeline_model_parallel_size=2 if pipeline > 1 else None,
    )  # fmt: skip
    return SimpleNamespace(config=config)


def test_auto_placement_with_pipelines_is_refused():
    # The planner that chooses simulates PP = 1; the engine says so before it looks at the model.
    with pytest.raises(ValueError, match=r"attention_wgrad_window=None \(auto\) needs PP = 1"):
        EPOverlapEngine([_chunk(pipeline=2)], None, overlap=True, delay_wgrad=True, attention_wgrad_window=None)


@pytest.mark.parametrize("window", [0, 3, "auto"])
def test_a_window_that_is_not_one_or_two_or_none_is_refused(window):
    with pytest.raises(ValueError, match=r"\[attention_wgrad_window\] ep_overlap.attention_wgrad_window="):
        EPOverlapEngine(_chunk(), None, overlap=True, attention_wgrad_window=window)


def test_a_chunk_without_the_declared_hooks_is_refused_naming_the_base_class():
    # The engine calls every chunk's hooks (contract.ChunkHooks) and reads every layer's (LayerHooks) directly.
    from megatron.bridge.training.ep_overlap.contract import ChunkHooks

    chunk = _chunk()
    chunk.config.bf16, chunk.config.ep_overlap_schedule = True, "bridge"
    with pytest.raises(TypeError, match=r"SimpleNamespace: a model chunk the engine runs inherits .*ChunkHooks"):
        EPOverlapEngine(chunk, None, overlap=True)

    class Chunk(ChunkHooks):
        config, layers = chunk.config, [SimpleNamespace()]

    with pytest.raises(TypeError, match=r"SimpleNamespace: a layer the engine runs inherits .*LayerHooks"):
        EPOverlapEngine(Chunk(), None, overlap=True)


@pytest.mark.parametrize(
    "overlap, delay, window, resolved",
    [
        (True, True, 2, (True, False, 2)),
        (True, True, None, (True, True, 1)),  # auto: the planner is still to choose (1 for the steps before it)
        (True, False, None, (False, False, 1)),  # nothing delayed: nothing to place
        (True, False, 2, (False, False, 2)),
        (False, True, None, (False, False, 1)),  # delayed wgrad runs only in the overlapped schedule
    ],
)
def test_settings_resolve_delayed_wgrad_and_the_window_once(overlap, delay, window, resolved):
    options = EPOverlapOptions(overlap=overlap, delay_wgrad=delay, attention_wgrad_window=window)
    settings = resolve(_chunk().config, options)
    assert (settings.delay_wgrad, settings.wgrad_window_auto, settings.attention_wgrad_window) == resolved


def test_the_planners_choice_is_where_auto_becomes_a_window():
    settings = resolve(_chunk().config, EPOverlapOptions(delay_wgrad=True, attention_wgrad_window=None))
    placed = ep_overlap_engine.placed(settings, 2)
    assert not placed.wgrad_window_auto and placed.attention_wgrad_window == placed.options.attention_wgrad_window == 2
    assert placed.violations == settings.violations
    plain = ep_overlap_engine.plain(settings)  # the measured step: nothing delayed, nothing to place
    assert not plain.delay_wgrad and not plain.wgrad_window_auto
    with pytest.raises(ValueError, match=r"the planner chose attention wgrad window 3, not one of \(1, 2\)"):
        ep_overlap_engine.placed(settings, 3)


def _auto_in_the_base_engine(rank: int, world: int) -> str:
    groups = init_ep_groups(2, timedelta(seconds=30))
    case = Case(layer_freq=(1, 1))
    model = MoEGPTModel(case.config(), groups, seed=7)
    from ep_overlap_lab.engine.driver import Engine

    engine = Engine(model, groups, overlap=True, delay_wgrad=True, attention_wgrad_window=None)
    assert engine.attention_wgrad_window is None  # still to choose
    engine.step(batches(case, rank, 0), forward_only=True)  # a forward-only step places no attention wgrad
    try:
        engine.step(batches(case, rank, 0))
    except ValueError as error:
        return str(error)
    return "ran"


def test_only_ep_overlap_engine_chooses_the_window():
    for outcome in run_local_ranks(_auto_in_the_base_engine, 2):
        assert outcome.result == "attention_wgrad_window=None (auto) is chosen by EPOverlapEngine; give 1 or 2 here"
