"""DualPipeV under Megatron-Core's driver contract: bitwise equal to Megatron-Core's plain 1F1B with the overlap off.

The same 4-layer ``GPTModel`` (a dense first layer, then MoE) on PP 2 x EP 2 (4 ranks) twice. The reference runs
Megatron-Core's non-interleaved 1F1B schedule (stages of two layers). The other builds DualPipeV's four one-layer
stages (rank 0: stages 0 and 3, with the embedding, the output layer and the loss; rank 1: stages 1 and 2), weights
keyed by global name, and takes its schedule from ``ep_overlap.mcore.get_forward_backward_func()`` with the config's
``ep_overlap_pipeline_schedule = "dualpipev"``: overlap off, then overlap on (the plan's paired F&B steps). Over 2
optimizer steps every loss, every gradient and every parameter after the steps must be bitwise equal, and so must the
losses of a forward-only step after them; each rank's P2P must be the generated op list's, transfer for
transfer. Cases beyond that one are ``full`` (below).
"""

from dataclasses import replace
from datetime import timedelta

import pytest
import torch

from .bitwise import assert_bitwise
from .local_ranks import run_local_ranks
from .mcore_cpu import init_megatron, install_cpu_stubs
from .mcore_models import McoreCase, gpt_config, gpt_model
from .mcore_stages import build_plans, global_name, set_weights
from .test_mcore_hook import MICRO_BATCH, SEQ, bridge_style_forward_step
from .test_plain_pipeline import _step_data

# The slower cases (more ranks, more arms) run with -m wide; make test holds the P = 2 case.
full = pytest.mark.wide
PP = 2
CASE = McoreCase(layer_freq=(0, 1, 1, 1), microbatches=2 * PP, steps=2)
# name: (case, pipeline size); one layer per DualPipeV stage, a dense first layer
CASES = {"gpt-dense-first-N4": (CASE, PP)}
FULL_CASES = {
    "gpt-N5-delayed-wgrad": (replace(CASE, microbatches=5, delay_wgrad=True), PP),
    "gpt-pp4-N8": (McoreCase(layer_freq=(0, 1, 1, 1, 1, 1, 1, 1), microbatches=8, steps=2), 4),
    "gpt-pp4-N9-delayed-wgrad": (
        McoreCase(layer_freq=(0, 1, 1, 1, 1, 1, 1, 1), microbatches=9, steps=2, delay_wgrad=True),
        4,
    ),
}


def dualpipev_models(case: McoreCase, pp: int) -> list:
    """This rank's chunks for DualPipeV's stages r and 2P-1-r (``dualpipev_chunks``) of ``case``'s model."""
    from megatron.bridge.training.ep_overlap.mcore.dualpipev import dualpipev_chunks

    config = gpt_config(
        case, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=2, pipeline_dtype=torch.float32
    )
    return dualpipev_chunks(lambda **chunk: gpt_model(case, config, **chunk), config)


def train(rank: int, world: int, case: McoreCase, layout: str, pp: int = PP) -> dict:
    install_cpu_stubs()
    init_megatron(case.world, pp, 2 if layout == "dualpipev" else None)
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules

    from megatron.bridge.training.ep_overlap.mcore import chunk_for, get_forward_backward_func, use_ep_overlap_schedule

    ep_rank, data_rank = parallel_state.get_expert_model_parallel_rank(), parallel_state.get_data_parallel_rank()
    arms = ("plain", "overlap") if layout == "dualpipev" else ("reference",)
    out = {"data_rank": data_rank}
    for arm in arms:
        if layout == "dualpipev":
            plans = [chunk_for(model) for model in dualpipev_models(case, pp)]
            set_weights(plans, local_experts=2, ep_rank=ep_rank)
        else:
            plans = build_plans(case, pp, None)
        models = [plan.model for plan in plans]
        config = models[0].config
        config.batch_p2p_comm, config.overlap_p2p_comm = False, False  # gloo: unbatched P2P
        if arm == "overlap":
            config.overlap_moe_expert_parallel_comm = True
            config.delay_wgrad_compute = case.delay_wgrad
            use_ep_overlap_schedule(models, timeout=timedelta(seconds=30))
        if layout == "dualpipev":
            config.ep_overlap_pipeline_schedule = "dualpipev"
            chosen = get_forward_backward_func(pp_size=pp, vp_size=2)
        else:
            chosen = schedules.forward_backward_pipelining_without_interleaving
        named = [(global_name(plan, n, 2, ep_rank), p) for plan in plans for n, p in plan.model.named_parameters()]
        optimizer = torch.optim.Adam([p for _, p in named], lr=1e-2)
        losses, grads, p2p = [], [], []
        for step in range(case.steps):
            data = _step_data(step, data_rank, case.microbatches)
            iterators = [iter(data), iter(list(data))] if layout == "dualpipev" else iter(data)
            extra = {"p2p_log": p2p} if layout == "dualpipev" else {}
            store = chosen(
                forward_step_func=bridge_style_forward_step, data_iterator=iterators, model=models,
                num_microbatches=case.microbatches, seq_length=SEQ, micro_batch_size=MICRO_BATCH, **extra,
            )  # fmt: skip
            losses.append(torch.stack([logged["lm loss"] for logged in store]) if store else None)
            grads.append({n: p.grad.clone() for n, p in named if p.grad is not None})
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        # An evaluation step (forward only) on step 0's data: its losses go after the training steps'.
        data = _step_data(0, data_rank, case.microbatches)
        iterators = [iter(data), iter(list(data))] if layout == "dualpipev" else iter(data)
        store = chosen(
            forward_step_func=bridge_style_forward_step, data_iterator=iterators, model=models,
            num_microbatches=case.microbatches, seq_length=SEQ, micro_batch_size=MICRO_BATCH, forward_only=True,
        )  # fmt: skip
        losses.append(torch.stack([logged["lm loss"] for logged in store]) if store else None)
        recorder = getattr(getattr(models[0], "build_schedule_plan", None), "recorder", None)
        phases = {str(r.phase) for r in recorder.comm if r.op == "dispatch"} if recorder is not None else set()
        params = {n: p.detach().clone() for n, p in named}
        out[arm] = {"losses": losses, "grads": grads, "params": params, "p2p": p2p, "phases": phases}
    out["pp_rank"] = parallel_state.get_pipeline_model_parallel_rank()
    return out


def _by_pipeline(outcomes, arm: str) -> dict:
    """Per data-parallel rank: the pipeline's losses per step and its gradients and parameters by global name."""
    merged = {}
    for outcome in outcomes:
        result = outcome.result[arm]
        into = merged.setdefault(outcome.result["data_rank"], {"losses": {}, "grads": {}, "params": {}})
        for step, losses in enumerate(result["losses"]):
            if losses is not None:
                into["losses"][step] = losses
        for step, grads in enumerate(result["grads"]):
            into["grads"].update({(step, name): grad for name, grad in grads.items()})
        into["params"].update(result["params"])
    return merged


def _assert_pipelines_bitwise(reference: dict, run: dict, where: str) -> None:
    assert reference.keys() == run.keys()
    for data_rank, ref in reference.items():
        got = run[data_rank]
        for part in ("losses", "grads", "params"):
            assert ref[part].keys() == got[part].keys() and ref[part], f"{where} {part}: {ref[part].keys()}"
            for key, value in ref[part].items():
                assert_bitwise(value, got[part][key], f"{where} data rank {data_rank} {part} {key}")


def assert_dualpipev_matches_1f1b(case: McoreCase, pp: int) -> None:
    from megatron.bridge.training.ep_overlap.program.dualpipev import dualpipev_schedule

    world = pp * case.world
    reference = _by_pipeline(run_local_ranks(train, world, (case, "1f1b", pp)), "reference")
    outcomes = run_local_ranks(train, world, (case, "dualpipev", pp))
    for arm in ("plain", "overlap"):
        _assert_pipelines_bitwise(reference, _by_pipeline(outcomes, arm), f"DualPipeV {arm}")
        for outcome in outcomes:
            steps = dualpipev_schedule(pp, case.microbatches, outcome.result["pp_rank"], overlap=arm == "overlap")
            generated = [(op, t) for s in steps for op, ts in (("recv", s.recv), ("send", s.send)) for t in ts]
            assert outcome.result[arm]["p2p"] == generated * case.steps, f"rank {outcome.rank} {arm}"
    assert {"paired"} <= set().union(*(o.result["overlap"]["phases"] for o in outcomes))


@pytest.mark.parametrize("name", sorted(CASES))
def test_dualpipev_is_bitwise_equal_to_megatron_cores_1f1b(name):
    assert_dualpipev_matches_1f1b(*CASES[name])


@full
@pytest.mark.parametrize("name", sorted(FULL_CASES))
def test_dualpipev_full_cases_are_bitwise_equal_to_megatron_cores_1f1b(name):
    assert_dualpipev_matches_1f1b(*FULL_CASES[name])


# name: (microbatches, what is set on the built chunks' config, on the built chunks, the line). Megatron-Core does not
# build a V chunk with MTP or a tied output layer (its embedding group spans pipeline ranks), so those are set after.
REFUSED = {
    "too-few-microbatches": (
        2 * PP - 1,
        {},
        {},
        "DualPipeV needs num_microbatches >= 2 x pipeline_model_parallel_size = 4 (got 3); fix: ",
    ),
    "mtp": (2 * PP, {"mtp_num_layers": 1}, {}, "DualPipeV does not run mtp_num_layers=1 yet; fix: "),
    "tied": (
        2 * PP,
        {},
        {"share_embeddings_and_output_weights": True},
        "DualPipeV does not run share_embeddings_and_output_weights=True yet; fix: ",
    ),
    "one-chunk": (2 * PP, {}, {"chunks": 1}, "DualPipeV runs two model chunks per pipeline rank"),
    "ddp-overlap-grad-reduce": (
        2 * PP,
        {"grad_sync_func": print},
        {},
        "DualPipeV does not call config.grad_sync_func yet (DDP's overlapped grad reduce); fix: ",
    ),
}


@full
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_dualpipev_does_not_run_is_refused_before_any_step(name):
    *change, line = REFUSED[name]
    for outcome in run_local_ranks(_refused, 4, tuple(change)):
        assert outcome.result.startswith(line), outcome.result
        assert "fix: " in outcome.result


def test_the_chunk_builder_refuses_an_mtp_layer_before_building_a_chunk():
    # Building one would block: the MTP layer all-reduces its embedding over a group the V layout does not match.
    from types import SimpleNamespace

    from megatron.bridge.training.ep_overlap.mcore.dualpipev import dualpipev_chunks

    built = []
    with pytest.raises(ValueError, match=r"^DualPipeV does not run mtp_num_layers=1 yet .*; fix: "):
        dualpipev_chunks(lambda **chunk: built.append(chunk), SimpleNamespace(mtp_num_layers=1))
    assert built == []


def _refused(rank: int, world: int, microbatches: int, config_fields: dict, chunk_fields: dict) -> str:
    install_cpu_stubs()
    init_megatron(CASE.world, PP, 2)
    from megatron.bridge.training.ep_overlap.mcore import get_forward_backward_func

    models = dualpipev_models(CASE, PP)[: chunk_fields.pop("chunks", 2)]
    for name, value in config_fields.items():
        setattr(models[0].config, name, value)
    for model in models:
        for name, value in chunk_fields.items():
            setattr(model, name, value)
    models[0].config.ep_overlap_pipeline_schedule = "dualpipev"
    data = _step_data(0, 0, microbatches)
    try:
        get_forward_backward_func(pp_size=PP, vp_size=2)(
            forward_step_func=bridge_style_forward_step, data_iterator=[iter(data), iter(data)], model=models,
            num_microbatches=microbatches, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
        )  # fmt: skip
    except ValueError as error:
        return str(error)
    return "ran"
