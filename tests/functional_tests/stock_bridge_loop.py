"""Stock Megatron-Bridge's own training loop on 2 gloo ranks, overlap off and with this project's hook (test-only).

    python stock_bridge_loop.py TREE OUT.json [--mtp] [--steps N] [--arms plain,hook] [--packed]
                                [--full_recompute recipe|hook] [--pp P] [--tp T] [--model olmoe|gpt_oss|latent_mtp]

Run by ``test_stock_bridge_loop.py`` with the scratch interpreter ``stock_bridge.py`` builds. ``TREE`` is the folder
that holds the ``megatron/bridge`` package this run imports: a site-packages with stock 0.6.2 and our plugin wheel, or
the ``src/`` of 0.6.2 with our patch applied. What runs is Bridge's and Megatron-Core's code:

    * the config: a ``ConfigContainer`` with a shrunk ``OlMoEModelProvider`` (a local layer spec, since Transformer
      Engine is not installed), or with ``--model gpt_oss`` the provider Bridge's ``GPTOSSBridge`` makes from a shrunk
      ``transformers`` ``GptOssConfig`` (its biases, sinks, sliding window, YaRN and clamped quick-GELU; on CPU
      without grouped GEMMs and the fused permute, which need Transformer Engine), validated by Bridge
      (``cfg.validate()``, which runs our ``EPOverlapCommOverlapConfig`` as the recipe's ``comm_overlap``);
    * ``initialize_megatron``'s steps (not its last, compiling dataset helpers: see :func:`initialize_on_cpu`), then
      ``setup()``'s model and optimizer steps: ``_build_distributed_model`` (``provide_distributed_model``,
      ``get_model``, Megatron-Core's DDP), ``setup_optimizer`` (Megatron-Core's optimizer) and
      ``_update_model_config_funcs`` (the grad-sync and finalize functions the driver calls);
    * Bridge's training loop ``train()`` with Bridge's ``gpt_step.forward_step`` (and its ``get_batch``), a
      callback recording each step. ``setup()`` is the first function that does not run on a CPU host: its
      ``initialize_megatron`` asserts CUDA (see ``docs/training/install.md``).

The recipe lines are the README's first-screen snippet. Stand-ins: the tests' CPU stubs for CUDA streams and the
current device (``mcore_cpu.install_cpu_stubs``) and the import-only Transformer Engine stand-in. Each arm writes,
per step, the reduced losses, every ``main_grad`` and every parameter after the optimizer step.
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SEQ, MICRO_BATCH, MICROBATCHES, VOCAB = 8, 2, 3, 64


def local_spec(config, vp_stage=None):
    """Megatron-Core's local (non-Transformer-Engine) decoder block spec; its core attention the tests' THD stand-in
    (causal within each packed document; the local attention unchanged for padded microbatches); with sequence
    parallelism, norms that take it (the local one refuses it; Transformer Engine's takes it)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from tests.unit_tests.training.ep_overlap.sp_norm import with_sequence_parallel_norms
    from tests.unit_tests.training.ep_overlap.thd_attention import with_packed_attention

    spec = with_packed_attention(get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage))
    return with_sequence_parallel_norms(spec) if config.sequence_parallel else spec


def local_mtp_provider():
    """``OlMoEModelProvider`` whose MTP block has local layers: Bridge 0.6.2's ``mtp_block_spec`` always asks for the
    Transformer Engine spec, so a recipe on a host without it provides the model itself (as a recipe may)."""
    from megatron.bridge.models.olmoe.olmoe_provider import OlMoEModelProvider
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    class LocalMTPOlMoEProvider(OlMoEModelProvider):
        def provide(self, pre_process=None, post_process=None, vp_stage=None):
            block = local_spec(self, vp_stage=vp_stage)
            return GPTModel(
                self,
                transformer_layer_spec=block,
                vocab_size=self.vocab_size,
                max_sequence_length=self.seq_length,
                position_embedding_type=self.position_embedding_type,
                rotary_base=self.rotary_base,
                share_embeddings_and_output_weights=self.share_embeddings_and_output_weights,
                pre_process=True if pre_process is None else pre_process,
                post_process=True if post_process is None else post_process,
                pg_collection=self._pg_collection,
                vp_stage=vp_stage,
                mtp_block_spec=get_gpt_mtp_block_spec(self, block.layer_specs[-1], use_transformer_engine=False),
            )

    return LocalMTPOlMoEProvider


def gpt_oss_provider():
    """Bridge 0.6.2's GPT-OSS provider, as its ``GPTOSSBridge`` makes it from the model's Hugging Face config (here a
    small one: the hub is not reached)."""
    from types import SimpleNamespace

    from megatron.bridge.models.gpt_oss.gpt_oss_bridge import GPTOSSBridge
    from transformers import GptOssConfig

    config = GptOssConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=16, num_attention_heads=2,
                          num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                          sliding_window=4, vocab_size=VOCAB, max_position_embeddings=SEQ)  # fmt: skip
    provider = GPTOSSBridge().provider_bridge(SimpleNamespace(config=config))
    provider.transformer_layer_spec = local_spec
    provider.moe_grouped_gemm = provider.moe_permute_fusion = False  # Transformer Engine's (GPU) kernels
    return provider


def recipe(
    arm: str,
    mtp: bool,
    steps: int,
    micro_batch: int,
    full_recompute: str = "",
    pp: int = 1,
    tp: int = 1,
    model_name: str = "olmoe",
):
    """The ``ConfigContainer`` a recipe would build; ``arm`` "hook" adds the README's two lines. ``full_recompute``:
    "recipe" sets full recompute (uniform, 1) on the recipe's model config in both arms; "hook" there for the plain
    arm only, and through the hook's ``full_recompute`` keyword for the hook arm. ``pp``: pipeline stages, without
    virtual ones (the plain 1F1B pipeline). ``tp``: tensor
    parallelism, with sequence parallelism (Megatron-Core's MoE layer refuses it without)."""
    import torch
    from megatron.bridge.models.olmoe.olmoe_provider import OlMoEModelProvider

    from tests.functional_tests.bridge_config import small_config

    shrunk = dict(
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=48,
        moe_ffn_hidden_size=16,
        num_attention_heads=2,
        num_query_groups=2,
        kv_channels=16,
        num_moe_experts=4,
        moe_router_topk=2,
        expert_model_parallel_size=2,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        use_cpu_initialization=True,
        seq_length=SEQ,
        vocab_size=VOCAB,
        make_vocab_size_divisible_by=VOCAB,
        bf16=True,  # Megatron-Core's config takes overlap_moe_expert_parallel_comm with bf16 or fp16 only
        params_dtype=torch.bfloat16,
        mtp_num_layers=1 if mtp else None,
        pipeline_model_parallel_size=pp,
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1,
        pipeline_dtype=torch.bfloat16 if pp > 1 else None,
        batch_p2p_comm=False,  # gloo pairs P2P in posting order; batched sends need NCCL's group semantics
    )
    if model_name == "gpt_oss":
        model = gpt_oss_provider()
        kept = ("bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion", "apply_rope_fusion")
        for name, value in shrunk.items():
            if name not in kept:  # its own fusions run on CPU as they are
                setattr(model, name, value)
    elif model_name == "latent_mtp":  # Nemotron 3 Super's MoE: latent projections (delaying their weight gradients
        # as Transformer Engine's without gradient_accumulation_fusion do), 2 MTP depths, 'moe' recomputed. (One MTP
        # layer repeated for them, as the recipe has it, needs the fusion with delayed wgrad: a rule refuses it.)
        shrunk |= dict(moe_latent_size=16, mtp_num_layers=2,
                       recompute_granularity="selective", recompute_modules=["moe"])  # fmt: skip
        model = local_mtp_provider()(transformer_layer_spec=local_spec, **shrunk)
    else:
        model = (local_mtp_provider() if mtp else OlMoEModelProvider)(transformer_layer_spec=local_spec, **shrunk)
    # Megatron-Core's bf16 optimizer takes CUDA tensors only: on CPU, its fp32 optimizer steps the bf16 weights with
    # bf16 grads, in both arms alike.
    cfg = small_config(model, steps=steps, global_batch=micro_batch * MICROBATCHES * 2, micro_batch=micro_batch,
                       seq=SEQ, vocab=VOCAB, lr=1e-2, bf16_optimizer=False, clip_grad=0.0, grad_reduce_in_fp32=False,
                       dist={"distributed_backend": "gloo"})  # fmt: skip
    if arm == "hook":
        # ---- the README's recipe lines ----
        from functools import partial

        from megatron.bridge.training.ep_overlap.mcore import use_ep_overlap_schedule
        from megatron.bridge.training.ep_overlap_config import EPOverlapCommOverlapConfig

        cfg.comm_overlap = EPOverlapCommOverlapConfig(  # every EP-overlap rule checked at setup: one error, each fix
            tp_comm_overlap=False, overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True
        )
        cfg.model.register_pre_wrap_hook(partial(use_ep_overlap_schedule, attention_wgrad_window=1))
        # ---- end of the recipe lines ----
        if full_recompute == "hook":
            cfg.model._pre_wrap_hooks[-1] = partial(
                use_ep_overlap_schedule, attention_wgrad_window=1, full_recompute=("uniform", 1)
            )
    if full_recompute == "recipe" or (full_recompute == "hook" and arm == "plain"):
        cfg.model.recompute_granularity, cfg.model.recompute_method, cfg.model.recompute_num_layers = (
            "full",
            "uniform",
            1,
        )
    return cfg


def batches(rank: int, step: int, mask_every: int, packed: bool = False, count: int = MICROBATCHES):
    """One step's ``count`` microbatches in the shape Bridge's ``get_batch`` reads (what its GPT datasets yield);
    ``packed``: each row holds two documents, with the boundaries Bridge's packed datasets add (``cu_seqlens_q``,
    ...)."""
    import torch

    gen = torch.Generator().manual_seed(1000 * step + rank)
    out = []
    for _ in range(count):
        rows = 1 if packed else MICRO_BATCH  # a packed microbatch is one row of documents
        tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=gen)
        loss_mask = torch.ones(rows, SEQ)
        if mask_every:
            loss_mask[:, ::mask_every] = 0.0  # some tokens do not count (padding, prompts)
        out.append({
            "tokens": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "loss_mask": loss_mask,
            "position_ids": torch.arange(SEQ)[None].expand(rows, SEQ).contiguous(),
            "attention_mask": None,
        })  # fmt: skip
        if packed:
            cu_seqlens = torch.tensor([0, 5, SEQ], dtype=torch.int32)
            out[-1]["position_ids"] = torch.cat([torch.arange(5), torch.arange(SEQ - 5)])[None]
            out[-1] |= {"cu_seqlens_q": cu_seqlens, "cu_seqlens_kv": cu_seqlens, "max_seqlen_q": torch.tensor(5),
                        "max_seqlen_kv": torch.tensor(5)}  # fmt: skip
    return out


def train_arm(
    rank: int,
    world: int,
    arm: str,
    mtp: bool,
    steps: int,
    mask_every: int,
    packed: bool,
    full_recompute: str,
    pp: int = 1,
    tp: int = 1,
    model_name: str = "olmoe",
) -> dict:
    cfg = recipe(arm, mtp, steps, 1 if packed else MICRO_BATCH, full_recompute, pp, tp, model_name)
    return bridge_train(cfg, steps, mask_every, packed)


def bridge_train(cfg, steps: int, mask_every: int, packed: bool = False) -> dict:
    """Bridge's setup steps and its ``train()`` for ``cfg`` on this rank (see the module docstring); the record."""
    import torch
    from megatron.bridge.training.config import runtime_config_update
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.initialize import destroy_global_state
    from megatron.bridge.training.optim import setup_optimizer
    from megatron.bridge.training.setup import _build_distributed_model, _update_model_config_funcs
    from megatron.bridge.training.state import GlobalState
    from megatron.bridge.training.train import train
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from tests.unit_tests.training.ep_overlap.mcore_cpu import plain_cuda_rng

    runtime_config_update(cfg)  # pretrain()'s first step: comm_overlap.setup, then cfg.validate()
    state = GlobalState()
    state.cfg = cfg
    pg_collection = initialize_on_cpu(cfg)
    plain_cuda_rng()  # Megatron-Core forks a CUDA RNG state for attention dropout
    torch.manual_seed(1234)  # the same initial weights in both arms (CPU initialization)
    built_with = {}
    provide = cfg.model.provide

    def provide_and_note(*args, **kwargs):  # the flags the layers see as they are built
        built_with.update(overlap=cfg.model.overlap_moe_expert_parallel_comm, delay=cfg.model.delay_wgrad_compute)
        return provide(*args, **kwargs)

    cfg.model.provide = provide_and_note
    model = _build_distributed_model(cfg, pg_collection)  # Megatron-Core's DDP, Bridge's pre-wrap hooks
    optimizer, scheduler = setup_optimizer(cfg.optimizer, cfg.scheduler, model)
    _update_model_config_funcs(model, cfg.model, cfg.ddp, optimizer, align_grad_reduce=cfg.dist.align_grad_reduce,
                               pg_collection=pg_collection)  # fmt: skip
    record = {"losses": [], "mtp_losses": [], "grads": [], "params": []}
    record["overlap_flag"] = model[0].config.overlap_moe_expert_parallel_comm
    record["built_with"] = built_with

    # Imported after the config: imported before it (with the Transformer Engine stand-in), checkpointing reaches
    # Megatron-Core's megatron.training package, which then asks for Transformer Engine's package metadata.
    from megatron.bridge.training.callbacks import Callback, normalize_callbacks
    from megatron.bridge.training.checkpointing import create_checkpoint_manager

    class Keep(Callback):
        """Each step's reduced losses, MTP loss, every main_grad and every parameter after the optimizer step."""

        def on_train_step_start(self, context):
            MTPLossLoggingHelper.clean_metrics_in_tracker()

        def on_train_step_end(self, context):
            assert not context.skipped_iter, "a step was skipped"
            named = _every_chunks_parameters(context.model)
            record["losses"].append({k: v.float().tolist() for k, v in context.loss_dict.items()})
            tracked = MTPLossLoggingHelper.tracker.get("loss_values")  # the MTP loss, summed over microbatches
            record["mtp_losses"].append(None if tracked is None else tracked.float().tolist())
            record["grads"].append({n: p.main_grad.float().flatten().tolist() for n, p in named})
            record["params"].append({n: p.detach().float().flatten().tolist() for n, p in named})

    from megatron.core import parallel_state

    data_rank = parallel_state.get_data_parallel_rank()  # the stages of a pipeline read the same microbatches
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    count = get_num_microbatches()  # what the config's global batch makes of it
    data = iter([mb for step in range(steps) for mb in batches(data_rank, step, mask_every, packed, count)])
    # Bridge's loop itself: train_step per iteration (zero_grad_buffer, the driver, optimizer.step), logging, exit.
    train(forward_step, model, optimizer, scheduler, data, None, state, create_checkpoint_manager(cfg.checkpoint),
          pg_collection, callback_manager=normalize_callbacks([Keep()]))  # fmt: skip
    assert len(record["losses"]) == steps, record["losses"]
    built = getattr(getattr(model[0], "module", None), "module", None)  # DDP(Float16Module(GPTModel))
    builder = getattr(built, "build_schedule_plan", None)
    record["plan"] = type(builder).__name__
    recorder = getattr(builder, "recorder", None)
    record["dispatches"] = 0 if recorder is None else sum(r.op == "dispatch" for r in recorder.comm)
    record["paired"] = recorder is not None and any(r.phase == "paired" for r in recorder.comm)
    destroy_global_state()  # Bridge's teardown between runs in one process
    return record


def _every_chunks_parameters(model: list) -> list:
    """Every model chunk's named parameters (with virtual stages, each name prefixed by its chunk)."""
    if len(model) == 1:
        return list(model[0].named_parameters())
    return [(f"chunk{v}.{n}", p) for v, chunk in enumerate(model) for n, p in chunk.named_parameters()]


def initialize_on_cpu(cfg):
    """``initialize_megatron``'s steps but its last: it also compiles Megatron-Core's dataset helpers with ``make``,
    and the Megatron-Core wheel ships no Makefile (the mock data here needs no helpers)."""
    from megatron.bridge.training.initialize import init_rerun_state, torch_dist_init
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

    train = cfg.train
    init_num_microbatches_calculator(__import__("torch").distributed.get_rank(), train.rampup_batch_size,
                                     train.global_batch_size, train.micro_batch_size, cfg.data_parallel_size,
                                     train.decrease_batch_size_if_needed)  # fmt: skip
    init_rerun_state(cfg.rerun_state_machine)
    return torch_dist_init(model_config=cfg.model, dist_config=cfg.dist, rng_config=cfg.rng,
                           micro_batch_size=train.micro_batch_size,
                           num_distributed_optimizer_instances=cfg.ddp.num_distributed_optimizer_instances,
                           get_embedding_ranks=None, get_position_embedding_ranks=None,
                           skip_mpu_initialization=False)  # fmt: skip


def rank_main(
    rank: int,
    world: int,
    arms: list[str],
    mtp: bool,
    steps: int,
    mask_every: int,
    packed: bool,
    full_recompute: str,
    pp: int,
    tp: int,
    model_name: str,
) -> dict:
    from tests.unit_tests.training.ep_overlap.mcore_cpu import install_cpu_stubs

    install_cpu_stubs()
    if model_name == "latent_mtp":
        from tests.unit_tests.training.ep_overlap.family_models import install_latent_projections

        install_latent_projections()
    return {
        arm: train_arm(rank, world, arm, mtp, steps, mask_every, packed, full_recompute, pp, tp, model_name)
        for arm in arms
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tree", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--mtp", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--mask_every", type=int, default=3)
    parser.add_argument("--arms", default="plain,hook")
    parser.add_argument("--packed", action="store_true")
    parser.add_argument("--full_recompute", choices=["", "recipe", "hook"], default="")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (no virtual ones); 2 x PP x TP ranks")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size, with sequence parallelism")
    parser.add_argument("--model", choices=["olmoe", "gpt_oss", "latent_mtp"], default="olmoe")
    args = parser.parse_args()
    from ep_overlap_lab.multiprocess import run_local_ranks

    arguments = (args.arms.split(","), args.mtp, args.steps, args.mask_every, args.packed, args.full_recompute,
                 args.pp, args.tp, args.model)  # fmt: skip
    outcomes = run_local_ranks(rank_main, 2 * args.pp * args.tp, arguments, collective_timeout_s=120)
    args.out.write_text(json.dumps([o.result for o in outcomes]))


if __name__ == "__main__":
    sys.path.insert(1, str(ROOT))  # the tests' CPU stubs (tests/...); never src/, which the tree stands for
    main()
