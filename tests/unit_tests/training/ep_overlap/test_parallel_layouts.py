"""Parallel layouts the engine does not run, and one the hook must refuse as Megatron-Core's forward does.

Four CPU ranks: TP 2 x EP 2, expert TP 2 x EP 2, CP 2 x EP 2. The engine sums gradients over data and expert
parallelism and counts each token's loss once per data-parallel rank; at TP 2 it would halve every TP-sharded
gradient and the loss and leave the norms' and routers' gradients unreduced, so it refuses the layout (and expert
TP's and CP's) by name when it is built, on every rank. Under
Megatron-Core's driver the hook runs TP 2 with sequence parallelism; without it, Megatron-Core's MoE layer refuses
in its forward, which the plan never calls, so the rules refuse it.
"""

from datetime import timedelta

import pytest

from .local_ranks import run_local_ranks
from .mcore_cpu import init_megatron, install_cpu_stubs
from .mcore_models import McoreCase, build_model


def _build(layout: dict, how: str, sequence_parallel: bool) -> str:
    install_cpu_stubs()
    sizes = {name: layout.get(name, 1) for name in ("tensor", "context", "expert_tensor")}
    init_megatron(2, **sizes)
    from megatron.bridge.training.ep_overlap.mcore import chunk_for, mcore_ep_groups, use_ep_overlap_schedule

    sizes = (
        ("tensor_model_parallel_size", layout.get("tensor", 1)),
        ("expert_tensor_parallel_size", layout.get("expert_tensor", 1)),
    )
    if layout.get("context", 1) > 1:  # an attention that takes it, so only the engine's own refusal is left
        from .test_context_parallel import GPT, _cp_gpt

        model = _cp_gpt(GPT)
    else:
        model = build_model(McoreCase(config=sizes))
    # Set after the build: the local norm refuses sequence parallelism when built (Transformer Engine's takes it);
    # here only the checks read it.
    model.config.sequence_parallel = sequence_parallel
    model.config.overlap_moe_expert_parallel_comm = True
    try:
        if how == "engine":
            from ep_overlap_lab.engine import EPOverlapEngine

            EPOverlapEngine(chunk_for(model), mcore_ep_groups(timedelta(seconds=30)), overlap=True)
        else:
            use_ep_overlap_schedule([model], timeout=timedelta(seconds=30))
    except ValueError as error:
        return str(error)
    return "accepted"


def _engine(rank: int, world: int, layout: dict) -> str:
    return _build(layout, "engine", sequence_parallel=layout.get("tensor", 1) > 1)


@pytest.mark.lab
@pytest.mark.parametrize(
    "layout, named",
    [
        ({"tensor": 2}, "tensor parallelism (2 ranks)"),
        ({"expert_tensor": 2}, "expert tensor parallelism (2 ranks)"),
        ({"context": 2}, "context parallelism (2 ranks)"),
    ],
    ids=["tp2", "etp2", "cp2"],
)
def test_the_engine_refuses_tensor_expert_tensor_and_context_parallelism_by_name_on_every_rank(layout, named):
    for outcome in run_local_ranks(_engine, 4, (layout,)):
        assert outcome.result.startswith("the EP-overlap engine cannot run this model: " + named), outcome.result
        assert "use_ep_overlap_schedule" in outcome.result and "sequence length" not in outcome.result


def _hook_without_sp(rank: int, world: int) -> str:
    return _build({"tensor": 2}, "hook", sequence_parallel=False)


def test_the_hook_refuses_moe_with_tensor_parallelism_and_no_sequence_parallelism():
    for outcome in run_local_ranks(_hook_without_sp, 4):
        assert "[moe_tp_needs_sp]" in outcome.result and "sequence_parallel=True" in outcome.result, outcome.result


def _pipeline_with_mtp_uniform2(rank: int, world: int) -> str:
    """PP 2 x VPP 2 x EP 2, an MTP layer on the last stage, full recompute ``uniform`` 2: what the stage without the
    MTP layer would accept on its own."""
    install_cpu_stubs()
    init_megatron(2, 2, 2)
    from megatron.bridge.training.ep_overlap.mcore import use_ep_overlap_schedule

    from .mcore_stages import build_plans

    case = McoreCase(layer_freq=(1, 0, 1, 1), mtp=True)
    models = [plan.model for plan in build_plans(case, 2, 2)]
    config = models[0].config
    config.recompute_granularity, config.recompute_method, config.recompute_num_layers = "full", "uniform", 2
    config.overlap_moe_expert_parallel_comm = True
    try:
        use_ep_overlap_schedule(models, timeout=timedelta(seconds=30))
    except ValueError as error:
        return str(error)
    return "accepted"


def test_a_pipeline_refuses_mtp_with_uniform_2_on_every_stage():
    for outcome in run_local_ranks(_pipeline_with_mtp_uniform2, 4):
        assert "[full_recompute_mtp]" in outcome.result and "recompute_num_layers=1" in outcome.result, outcome.result


def _one_rank_refuses(rank: int, world: int) -> str:
    install_cpu_stubs()
    init_megatron(2)
    from megatron.bridge.training.ep_overlap.mcore import use_ep_overlap_schedule

    model = build_model(McoreCase())
    if rank == 1:
        model.position_embedding_type = "mrope"  # only this rank's plan refuses
    try:
        use_ep_overlap_schedule([model], timeout=timedelta(seconds=30))
    except ValueError as error:
        return str(error)
    return "accepted"


def test_a_refusal_on_one_rank_is_every_ranks_before_any_step():
    outcomes = run_local_ranks(_one_rank_refuses, 2)
    assert outcomes[1].result.startswith("position_embedding_type='mrope'"), outcomes[1].result
    assert outcomes[0].result.startswith("rank 1 refused this model, so every rank does: ValueError: position_embed")
