"""A Bridge-style loop picks the EP-overlap schedule from the model config via forward_step's schedule plans."""

from datetime import timedelta

import torch

from ep_overlap_lab.moe_gpt import MoEGPTModel
from ep_overlap_lab.step import MicrobatchPlan, forward_step, train_step
from megatron.bridge.training.comm_overlap import CommOverlapConfig

from .local_ranks import init_ep_groups, run_local_ranks
from .workers import Case, batches


def _loop(rank: int, world: int) -> dict:
    case = Case()
    groups = init_ep_groups(2, timedelta(seconds=30))
    out = {}
    for overlap in (False, True):
        config = case.config()
        CommOverlapConfig(tp_comm_overlap=False, overlap_moe_expert_parallel_comm=overlap).setup(config)
        model = MoEGPTModel(config, groups, seed=5)
        result = train_step(forward_step, iter(batches(case, rank, 0)), model, groups, case.microbatches)
        out[overlap] = {
            "losses": torch.stack(result.losses),
            "phases": {r.phase for r in result.recorder.comm},
            "grad": model.layers[0].router.weight.grad.clone(),
        }
    plan, _ = forward_step(None, iter(batches(case, rank, 0)), "model", return_schedule_plan=True)
    out["plan"] = isinstance(plan, MicrobatchPlan) and plan.model == "model"
    return out


def test_train_step_follows_the_model_config():
    for outcome in run_local_ranks(_loop, 2):
        plain, overlapped = outcome.result[False], outcome.result[True]
        assert plain["phases"] == {"plain"}
        assert {"warmup", "paired", "cooldown"} <= overlapped["phases"]
        assert torch.equal(plain["losses"], overlapped["losses"])
        assert torch.equal(plain["grad"], overlapped["grad"])
        assert outcome.result["plan"]


def test_plain_forward_step_returns_loss_and_loss_func():
    case = Case(world=1, ep=1)
    model = MoEGPTModel(case.config())
    loss, func = forward_step(None, iter(batches(case, 0, 0)), model)
    value, logged = func(loss)
    assert value.dim() == 0 and torch.isfinite(value) and "lm loss" in logged


def _under_no_grad(rank: int, world: int) -> dict:
    from ep_overlap_lab.engine import EPOverlapEngine

    case = Case()
    groups = init_ep_groups(2, timedelta(seconds=30))
    out = {}
    for overlap in (False, True):
        model = MoEGPTModel(case.config(), groups, seed=5)
        engine = EPOverlapEngine(model, groups, overlap=overlap)
        with torch.no_grad():
            try:
                engine.step(batches(case, rank, 0))
                out[overlap] = "trained"
            except RuntimeError as exc:
                out[overlap] = str(exc)
            forward = engine.step(batches(case, rank, 0), forward_only=True)  # a forward-only step still runs
        out[f"grads {overlap}"] = any(p.grad is not None for p in model.parameters())
        out[f"forward {overlap}"] = len(forward.losses)
    return out


def test_a_training_step_under_no_grad_is_refused_on_both_paths():
    for outcome in run_local_ranks(_under_no_grad, 2):
        for overlap in (False, True):
            assert outcome.result[overlap].startswith("step() under torch.no_grad(): a training step needs autograd")
            assert not outcome.result[f"grads {overlap}"]
            assert outcome.result[f"forward {overlap}"] == Case().microbatches
