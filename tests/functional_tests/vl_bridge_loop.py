"""Megatron-Bridge 0.6.2's own training loop on small Qwen3-VL MoE and Qwen3.5-VL MoE models, overlap off and with
this project's hook (test-only; run by ``test_vision_language.py`` in the stock-Bridge scratch interpreter).

    python vl_bridge_loop.py TREE OUT.json [--steps N] [--arms plain,hook] [--models qwen3_vl,qwen35_vl]

Two gloo ranks, EP 2. ``TREE`` holds the ``megatron/bridge`` this run imports: stock 0.6.2 with our plugin wheel, or
0.6.2's sources with our patch. The config is a ``ConfigContainer`` around the provider Bridge's ``Qwen3VLMoEBridge``
(or ``Qwen35VLMoEBridge``) makes from a small Hugging Face config, with the README's recipe lines in the hook arm;
``vl_support.for_recipe`` gives the rest (the local specs, the vision tower's size, the image+text microbatches,
Bridge's ``qwen3_vl_step.forward_step``). Then Bridge's steps as ``stock_bridge_loop.py`` runs them:
``runtime_config_update``, the CPU part of ``initialize_megatron``, ``_build_distributed_model`` (the pre-wrap hooks,
DDP), ``setup_optimizer``, ``_update_model_config_funcs``, and ``train()``. Each arm writes, per step, the reduced
losses, every ``main_grad`` and every parameter after the optimizer step.
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SEQ, ROWS, MICROBATCHES, VOCAB = 16, 2, 4, 64


def recipe(model_name: str, arm: str, steps: int):
    """The ``ConfigContainer`` a recipe would build; ``arm`` "hook" adds the README's recipe lines."""
    from tests.functional_tests import vl_support
    from tests.functional_tests.bridge_config import small_config

    small = vl_support.small_qwen35_vl_provider if model_name == "qwen35_vl" else vl_support.small_qwen3_vl_provider
    cfg = small_config(small(layers=2, seq=SEQ, vocab=VOCAB), steps=steps,
                       global_batch=ROWS * MICROBATCHES * 2, micro_batch=ROWS, seq=SEQ, vocab=VOCAB, lr=1e-2,
                       bf16_optimizer=False, clip_grad=0.0, grad_reduce_in_fp32=False,
                       dist={"distributed_backend": "gloo"})  # fmt: skip
    if arm == "hook":
        from functools import partial

        from megatron.bridge.training.ep_overlap.mcore import use_ep_overlap_schedule
        from megatron.bridge.training.ep_overlap_config import EPOverlapCommOverlapConfig

        cfg.comm_overlap = EPOverlapCommOverlapConfig(
            tp_comm_overlap=False, overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True
        )
        cfg.model.register_pre_wrap_hook(partial(use_ep_overlap_schedule, attention_wgrad_window=1))
    return cfg


def bridge_train_vl(cfg, steps: int) -> dict:
    """Bridge's setup steps and its ``train()`` for a VL ``cfg`` (its language model at CPU size) on this rank, with
    ``vl_support.for_recipe``'s forward step and data; the record, with the keys ``stock_bridge_loop.bridge_train``
    writes (the recipe check's verdict reads them), and ``chunk``, the plan's class."""
    import torch
    from megatron.bridge.training.config import runtime_config_update
    from megatron.bridge.training.initialize import destroy_global_state
    from megatron.bridge.training.optim import setup_optimizer
    from megatron.bridge.training.setup import _build_distributed_model, _update_model_config_funcs
    from megatron.bridge.training.state import GlobalState
    from megatron.bridge.training.train import train
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    from tests.functional_tests import vl_support
    from tests.functional_tests.stock_bridge_loop import _every_chunks_parameters, initialize_on_cpu
    from tests.unit_tests.training.ep_overlap.mcore_cpu import plain_cuda_rng

    vl = vl_support.for_recipe(cfg)
    runtime_config_update(cfg)  # pretrain()'s first step: comm_overlap.setup, then cfg.validate()
    state = GlobalState()
    state.cfg = cfg
    pg_collection = initialize_on_cpu(cfg)
    plain_cuda_rng()
    torch.manual_seed(1234)  # the same initial weights in both arms (CPU initialization)
    model = _build_distributed_model(cfg, pg_collection)
    optimizer, scheduler = setup_optimizer(cfg.optimizer, cfg.scheduler, model)
    _update_model_config_funcs(model, cfg.model, cfg.ddp, optimizer, align_grad_reduce=cfg.dist.align_grad_reduce,
                               pg_collection=pg_collection)  # fmt: skip
    record = {"losses": [], "mtp_losses": [], "grads": [], "params": []}
    record["overlap_flag"] = model[0].config.overlap_moe_expert_parallel_comm

    # Imported after the config, as stock_bridge_loop.py does (checkpointing reaches Megatron-Core's training package).
    from megatron.bridge.training.callbacks import Callback, normalize_callbacks
    from megatron.bridge.training.checkpointing import create_checkpoint_manager

    class Keep(Callback):
        def on_train_step_end(self, context):
            assert not context.skipped_iter, "a step was skipped"
            named = [(n, p) for n, p in _every_chunks_parameters(context.model) if p.requires_grad]  # not frozen
            record["losses"].append({k: v.float().tolist() for k, v in context.loss_dict.items()})
            record["mtp_losses"].append(None)  # the plan refuses an MTP layer with a VL model
            record["grads"].append({n: p.main_grad.float().flatten().tolist() for n, p in named})
            record["params"].append({n: p.detach().float().flatten().tolist() for n, p in named})

    data = vl.data(parallel_state.get_data_parallel_rank(), steps, get_num_microbatches())
    train(vl.forward_step, model, optimizer, scheduler, data, None, state, create_checkpoint_manager(cfg.checkpoint),
          pg_collection, callback_manager=normalize_callbacks([Keep()]))  # fmt: skip
    built = model[0].module.module  # DDP(Float16Module(Qwen3VLModel))
    builder = getattr(built, "build_schedule_plan", None)
    record["plan"], record["chunk"] = type(builder).__name__, type(getattr(builder, "chunk", None)).__name__
    recorder = getattr(builder, "recorder", None)
    record["dispatches"] = 0 if recorder is None else sum(r.op == "dispatch" for r in recorder.comm)
    record["paired"] = recorder is not None and any(r.phase == "paired" for r in recorder.comm)
    destroy_global_state()
    return record


def rank_main(rank: int, world: int, models: list[str], arms: list[str], steps: int) -> dict:
    from tests.unit_tests.training.ep_overlap.mcore_cpu import install_cpu_stubs

    install_cpu_stubs()
    return {name: {arm: bridge_train_vl(recipe(name, arm, steps), steps) for arm in arms} for name in models}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tree", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--arms", default="plain,hook")
    parser.add_argument("--models", default="qwen3_vl", help="comma-separated: qwen3_vl, qwen35_vl")
    args = parser.parse_args()
    from ep_overlap_lab.multiprocess import run_local_ranks

    arguments = (args.models.split(","), args.arms.split(","), args.steps)
    outcomes = run_local_ranks(rank_main, 2, arguments, collective_timeout_s=120)
    args.out.write_text(json.dumps([o.result for o in outcomes]))


if __name__ == "__main__":
    sys.path.insert(1, str(ROOT))  # the tests' CPU stand-ins (tests/...); never src/, which the tree stands for
    main()
