"""EP overlap in the plain 1F1B pipeline (PP > 1, no virtual stages) under Megatron-Core's driver contract.

Each case builds the same Megatron-Core model on PP x EP 2 ranks (PP 2, or 4 where named) twice: the reference
runs Megatron-Core's non-interleaved schedule with the overlap off; the other turns the overlap on, installs the hook
and takes its schedule from ``ep_overlap.mcore.get_forward_backward_func()``, as the patched ``train()`` does. Over 2
steps (an optimizer step between) every loss and every gradient must be bitwise equal, and the overlapped arm must
have run paired steps (unless too few microbatches, where the step is the plain one). Layouts
(``pipeline_model_parallel_layout``) are Megatron-Core's; one that puts the MTP layer apart from the loss is refused.
"""

from dataclasses import replace
from datetime import timedelta

import pytest
import torch

from .bitwise import assert_bitwise
from .fake_deepep import install_fake_deepep
from .local_ranks import run_local_ranks
from .mcore_cpu import init_megatron, install_cpu_stubs
from .mcore_models import HybridCase, McoreCase
from .test_mcore_hook import MICRO_BATCH, SEQ, bridge_style_forward_step

PP = 2
# DeepSeek-V3's recipe layout, shrunk: the embedding with the first layers; MTP and the loss on the last stage.
DEEPSEEK_LAYOUT = (("embedding", "decoder", "decoder"), ("decoder", "decoder", "mtp", "loss"))
# The last stage holds only the MTP layer and the loss: the final norm ends the other stage (Megatron-Core puts it on
# the stage of the last decoder layer when there is an MTP layer).
MTP_STAGE_LAYOUT = (("embedding", "decoder", "decoder", "decoder", "decoder"), ("mtp", "loss"))
# Four stages, uneven: an embedding-only first stage, two layers on the second, MTP beside the last layer.
UNEVEN_LAYOUT = (("embedding",), ("decoder", "decoder"), ("decoder",), ("decoder", "mtp", "loss"))


def _with_layout(case, layout):
    """``case`` built with ``pipeline_model_parallel_layout`` (lists, as a recipe gives it)."""
    return replace(case, config=(*case.config, ("pipeline_model_parallel_layout", [list(s) for s in layout])))


def _step_data(step: int, data_rank: int, microbatches: int) -> list:
    gen = torch.Generator().manual_seed(100 * step + data_rank)
    return [tuple(torch.randint(0, 64, (2, MICRO_BATCH, SEQ), generator=gen)) for _ in range(microbatches)]


def train_plain_pipeline(rank: int, world: int, case, arms: tuple, pp: int = PP) -> dict:
    """Per arm: losses (last stage) and gradients per step, and what the call left on the config."""
    install_cpu_stubs()
    if case.dispatcher == "flex":
        install_fake_deepep()
    init_megatron(case.world, pp, None)
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules

    from megatron.bridge.training.ep_overlap.mcore import get_forward_backward_func, use_ep_overlap_schedule

    from .mcore_stages import build_plans

    out = {}
    created, new_group = [], torch.distributed.new_group

    def recording_new_group(ranks=None, *args, **kwargs):
        created.append(tuple(ranks))
        return new_group(ranks, *args, **kwargs)

    for arm in arms:
        model = build_plans(case, pp, None)[0].model
        config = model.config
        # Megatron-Core's non-interleaved schedule refuses overlap_p2p_comm; gloo needs unbatched P2P.
        config.batch_p2p_comm, config.overlap_p2p_comm = False, False
        if arm != "reference":
            config.overlap_moe_expert_parallel_comm = True  # set after the build: Megatron-Core refuses it there
            config.delay_wgrad_compute = arm == "delayed"
            torch.distributed.new_group = recording_new_group
            try:
                use_ep_overlap_schedule([model], timeout=timedelta(seconds=30))
            finally:
                torch.distributed.new_group = new_group
        if arm == "reference":
            chosen = schedules.forward_backward_pipelining_without_interleaving
        else:
            chosen = get_forward_backward_func(pp_size=pp, vp_size=None)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses, grads, phases = [], [], set()
        for step in range(case.steps):
            data = _step_data(step, parallel_state.get_data_parallel_rank(), case.microbatches)
            store = chosen(
                forward_step_func=bridge_style_forward_step, data_iterator=iter(data), model=[model],
                num_microbatches=case.microbatches, seq_length=SEQ, micro_batch_size=MICRO_BATCH, forward_only=False,
            )  # fmt: skip
            losses.append(torch.stack([logged["lm loss"] for logged in store]) if store else None)
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            recorder = getattr(getattr(model, "build_schedule_plan", None), "recorder", None)
            if arm != "reference" and recorder is not None:
                phases |= {str(r.phase) for r in recorder.comm if r.op == "dispatch"}
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        out[arm] = {"losses": losses, "grads": grads, "phases": phases}
        out[arm]["config_after"] = (
            config.virtual_pipeline_model_parallel_size,
            config.overlap_moe_expert_parallel_comm,
            config.overlap_p2p_comm,
            parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        )
    # The hook's gloo groups: its EP agreement's only; Megatron-Core's driver sends between stages itself.
    out["hook_groups"] = set(created)
    ranks_of = torch.distributed.get_process_group_ranks
    out["ep_ranks"] = tuple(ranks_of(parallel_state.get_expert_model_parallel_group()))
    out["pp_ranks"] = tuple(ranks_of(parallel_state.get_pipeline_model_parallel_group()))
    return out


def assert_arms_equal(outcomes, case, arm: str) -> set:
    phases = set()
    last_stage = len(outcomes) - case.world  # ranks are pipeline-major: the last EP group is the last stage
    for outcome in outcomes:
        created = outcome.result["hook_groups"]
        assert outcome.result["ep_ranks"] in created and outcome.result["pp_ranks"] not in created, created
        ref, run = outcome.result["reference"], outcome.result[arm]
        for step in range(case.steps):
            where = f"rank {outcome.rank} {arm} step {step}"
            assert (ref["losses"][step] is None) == (outcome.rank < last_stage)  # losses on the last stage only
            if ref["losses"][step] is not None:
                assert_bitwise(ref["losses"][step], run["losses"][step], f"{where} losses")
            assert ref["grads"][step].keys() == run["grads"][step].keys() and ref["grads"][step], where
            for param, grad in ref["grads"][step].items():
                assert_bitwise(grad, run["grads"][step][param], f"{where} {param}")
        # the call put back what it changed for its length
        assert run["config_after"] == (None, True, False, None), run["config_after"]
        phases |= run["phases"]
    return phases


GPT = McoreCase(layer_freq=(1, 0, 1, 1), steps=2)
HYBRID = HybridCase(pattern="*E-E|*-E*", steps=2)
CASES = {
    "gpt-N4": (replace(GPT, microbatches=4), ("overlap",)),
    "gpt-N3-not-a-multiple-delayed": (replace(GPT, microbatches=3), ("overlap", "delayed")),
    "gpt-N5-mtp-rope": (replace(GPT, microbatches=5, mtp=True, rope=True), ("overlap",)),
    "gpt-N3-full-uniform1": (replace(GPT, microbatches=3, full_recompute=("uniform", 1)), ("overlap",)),
    "gpt-N3-flex-delayed": (replace(GPT, microbatches=3, dispatcher="flex"), ("delayed",)),
    "hybrid-N3": (replace(HYBRID, microbatches=3), ("overlap",)),
    # DeepSeek-V3's layout: a dense first layer, MTP with RoPE on the last stage (its MTP layer reads the layout).
    "gpt-N4-deepseek-layout-mtp": (
        _with_layout(replace(GPT, layer_freq=(0, 1, 1, 1), microbatches=4, mtp=True, rope=True), DEEPSEEK_LAYOUT),
        ("overlap", "delayed"),
    ),
    "gpt-N4-mtp-stage-layout": (
        _with_layout(replace(GPT, layer_freq=(0, 1, 1, 1), microbatches=4, mtp=True, rope=True), MTP_STAGE_LAYOUT),
        ("overlap",),
    ),
}
# PP 4 x EP 2, 8 ranks: the same layout shape, uneven, N not a multiple of PP.
CASES_PP4 = {
    "gpt-N5-uneven-layout-mtp": (
        _with_layout(replace(GPT, layer_freq=(0, 1, 1, 1), microbatches=5, mtp=True, rope=True), UNEVEN_LAYOUT),
        ("overlap",),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_plain_pipeline_overlap_is_bitwise_equal_to_megatron_cores_1f1b(name):
    case, arms = CASES[name]
    outcomes = run_local_ranks(train_plain_pipeline, PP * case.world, (case, ("reference", *arms)))
    for arm in arms:
        assert "paired" in assert_arms_equal(outcomes, case, arm)


@pytest.mark.parametrize("name", sorted(CASES_PP4))
def test_plain_pipeline_overlap_at_four_stages_is_bitwise_equal(name):
    case, arms = CASES_PP4[name]
    outcomes = run_local_ranks(train_plain_pipeline, 4 * case.world, (case, ("reference", *arms), 4))
    for arm in arms:
        assert "paired" in assert_arms_equal(outcomes, case, arm)


def test_fewer_microbatches_than_stages_run_megatron_cores_plain_schedule():
    # N = 1 < PP cannot pair: the step is Megatron-Core's plain 1F1B, with the same numbers.
    case = replace(GPT, microbatches=1)
    outcomes = run_local_ranks(train_plain_pipeline, 4, (case, ("reference", "overlap")))
    assert "paired" not in assert_arms_equal(outcomes, case, "overlap")


def _hook_with_standalone_mtp(rank: int, world: int) -> str:
    install_cpu_stubs()
    init_megatron(2, PP, None)
    from megatron.bridge.training.ep_overlap.mcore import use_ep_overlap_schedule

    from .mcore_stages import gpt_stage_models

    case = _with_layout(replace(GPT, mtp=True), STANDALONE_MTP_LAYOUT)
    model = gpt_stage_models(case, PP, None)[0]
    model.config.overlap_moe_expert_parallel_comm = True
    try:
        use_ep_overlap_schedule([model], timeout=timedelta(seconds=30))
    except ValueError as error:
        return str(error)
    return "accepted"


# The MTP layer on a stage of its own, before the loss's stage (Megatron-Core's standalone MTP).
STANDALONE_MTP_LAYOUT = (("embedding", "decoder", "decoder", "decoder", "decoder", "mtp"), ("loss",))


def test_a_layout_with_the_mtp_layer_apart_from_the_loss_is_refused_on_every_rank():
    for outcome in run_local_ranks(_hook_with_standalone_mtp, 4):
        assert "puts the multi-token prediction layer on pipeline stage 0, apart from the loss" in outcome.result, (
            outcome.result
        )
        assert "fix: list 'mtp' in the last stage" in outcome.result
