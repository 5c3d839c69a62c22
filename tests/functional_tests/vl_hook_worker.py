"""Megatron-Bridge 0.6.2's Qwen3-VL MoE and Qwen3.5-VL MoE models under Megatron-Core's own driver: plain, and running
this project's plan through the hook (test-only; run by ``test_vision_language.py`` in the stock-Bridge scratch
interpreter).

    python vl_hook_worker.py TREE OUT.json [--pp 1|2] [--tp 1|2] [--cp 1|2] [--steps N] [--models qwen3_vl,qwen35_vl]
                             [--full_recompute] [--mutate vision|mrope|...|sp-split|cp-split]

Two gloo ranks with EP 2 (``--pp 2``: four, PP 2 x VPP 2 x EP 2, Megatron-Core's interleaved schedule with its P2P
hooks; ``--tp 2`` doubles the ranks: TP 2 with sequence parallelism, the tests' norms taking it; ``--cp 2`` makes the
two ranks a context-parallel pair, which EP 2 spans: the tests' attention takes it, and the step splits labels and
loss mask over the pair and leaves the input ids whole, as ``qwen3_vl_step`` does). Each model of ``--models`` is
Bridge's ``Qwen3VLModel`` as its provider builds it, small (``vl_support.py``: local specs, images of 4 x 4 patches
made here): Qwen3-VL's attention layers and deepstack features, or Qwen3.5-VL's gated delta net and gated
attention layers with gated shared experts and one MTP layer. Every step mixes microbatches with images (one row with
two) and text-only ones. The forward step is ``qwen3_vl_step.forward_step``'s, patched: the plan gets the forward's
arguments, images included. Each arm trains ``--steps`` Adam steps and writes every microbatch's logged loss, every
gradient and every parameter after each step, and the patches each call of the vision tower got.
``--vision_dp_when_cp`` (with ``--cp 2``): each context-parallel rank runs its share of a microbatch's images through
the vision tower and the ranks gather the embeddings (the model's ``vision_dp_when_cp``).


``--full_recompute``: the language layers recomputed (``uniform``, 1), set on the built config in both arms, as the
hook's keyword sets it (the vision tower is built without it). ``--mutate`` makes the plan skip one part it must run,
to show the test catches it: ``vision`` (the vision tower and its merge), ``mrope`` (text positions instead of the
images' on every chunk), ``mrope-later`` (on chunks without the embedding only), ``deepstack`` (the deepstack
features), ``mtp-rotary`` (the MTP layer in the head without the microbatch's multimodal rotary embedding),
``sp-split`` (with ``--tp 2``: every rank keeps the first part of the image mask and deepstack features),
``cp-split`` (with ``--cp 2``: every rank keeps the first context-parallel part of the merged embeddings, image mask,
deepstack features and positions).
"""

import argparse
import json
import sys
from datetime import timedelta
from functools import partial
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
SEQ, ROWS, VOCAB = 16, 2, 64


def masked_token_loss(loss_mask_BS, per_token_BS):
    """Megatron-Bridge's ``masked_next_token_loss`` shape: (token-summed loss, token count, what to log)."""
    import torch

    losses, mask = per_token_BS.view(-1).float(), loss_mask_BS.view(-1).float()
    loss = torch.sum(losses * mask)
    count = mask.sum().clone().detach().to(torch.int)
    return loss, count, {"lm loss": torch.cat([loss.clone().detach().view(1), count.view(1)])}


def vl_forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """``qwen3_vl_step.forward_step`` as this project's patch makes it: the plain forward and the plan get the same
    arguments (position ids None: the model computes its multimodal ones; the images and their grids)."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    batch = next(data_iterator)
    visual = batch["visual_inputs"]
    images = visual.normalized_for_model() if visual is not None else {}
    # This context-parallel rank's labels and loss mask; the input ids stay whole (the model splits them).
    split = get_batch_on_this_cp_rank(
        {"labels": batch["labels"], "loss_mask": batch["loss_mask"]},
        is_hybrid_cp=False,
        cp_group=parallel_state.get_context_parallel_group(),
    )
    args = dict(input_ids=batch["tokens"], position_ids=None, attention_mask=None, labels=split["labels"],
                loss_mask=split["loss_mask"], **images)  # fmt: skip
    loss_func = partial(masked_token_loss, split["loss_mask"])
    if return_schedule_plan:
        return model.build_schedule_plan(**args), loss_func
    return model(**args), loss_func


def mutate(part: str) -> None:
    """The plan skips ``part`` (see the module docstring): for showing that the test fails without it."""
    from megatron.bridge.training.ep_overlap.mcore import vision_language as vl

    plan = vl.McoreVisionLanguageChunk
    if part == "vision":
        embed = plan.embed_images
        plan.embed_images = lambda self, tokens, inputs: embed(self, tokens, {})
    elif part in ("mrope", "mrope-later"):
        rotary = plan.rotary_for_microbatch

        def text_positions(self, input_ids, position_ids, inputs):
            later = part == "mrope-later" and not self.pre_process
            return rotary(self, input_ids, position_ids, {} if part == "mrope" or later else inputs)

        plan.rotary_for_microbatch = text_positions
    elif part == "deepstack":
        vl._DeepstackLayer._with_feature = lambda self, x: x
    elif part == "mtp-rotary":  # the head's MTP layer reads no rotary embedding, not the microbatch's multimodal one
        per_token = plan.per_token_losses

        def without_rotary(self, x_SBH, labels_BS, tokens_BS=None, loss_mask_BS=None, microbatch=None):
            if microbatch is not None:
                fields = ("position_ids", "attention_mask", "packed_seq_params")
                microbatch = SimpleNamespace(rotary_pos_emb=None, **{f: getattr(microbatch, f) for f in fields})
            return per_token(self, x_SBH, labels_BS, tokens_BS, loss_mask_BS, microbatch)

        plan.per_token_losses = without_rotary
    elif part == "sp-split":  # the plan's split only (the model imported the function by name)
        import megatron.bridge.models.qwen_vl.modelling_qwen3_vl.utils as utils

        split = utils.split_deepstack_embs
        utils.split_deepstack_embs = lambda *args, **kwargs: split(*args, **{**kwargs, "tp_rank": 0})
    elif part == "cp-split":  # the plan's splits only: every rank keeps the first context-parallel part
        import megatron.bridge.models.qwen_vl.modelling_qwen3_vl.utils as utils

        split, split_deepstack = utils.split_data_cp_rank, utils.split_deepstack_embs
        utils.split_data_cp_rank = lambda val, cp_size, seq_dim, cp_rank=None: split(val, cp_size, seq_dim, 0)
        utils.split_deepstack_embs = lambda *args, **kwargs: split_deepstack(*args, **{**kwargs, "cp_rank": 0})


def build_chunks(provider, pp: int) -> list:
    """The rank's model chunks, as Bridge's ``get_model`` builds them from the provider (one per virtual stage at
    PP 2). Bridge 0.6.2's Qwen3-VL MoE provider drops ``vp_stage`` (Megatron-Core's block then refuses to build under
    virtual stages), so its chunks are made as its ``provide`` makes them, given their virtual stage."""
    import torch
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model import Qwen3VLModel
    from megatron.bridge.models.qwen_vl.qwen3_vl_provider import Qwen3VLMoEModelProvider
    from megatron.core import parallel_state

    from tests.functional_tests.vl_support import local_layer_spec

    torch.manual_seed(1234)  # both arms start from the same weights
    stages = [None] if pp == 1 else [0, 1]
    chunks = []
    for stage in stages:
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=stage is None, vp_stage=stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=stage is None, vp_stage=stage)
        if stage is None or not isinstance(provider, Qwen3VLMoEModelProvider):
            model = provider.provide(pre_process=pre, post_process=post, vp_stage=stage)
        else:
            model = Qwen3VLModel(
                language_transformer_config=provider,
                language_transformer_layer_spec=local_layer_spec(provider.num_moe_experts, qk_layernorm=True),
                vision_transformer_config=provider.vision_config,
                pre_process=pre,
                post_process=post,
                pg_collection=provider._pg_collection,
                vp_stage=stage,
            )
        chunks.append(_as_get_model_leaves_it(model, stage))
    return chunks


def _as_get_model_leaves_it(model, vp_stage):
    """The model as Bridge's ``get_model`` leaves it (its type and virtual stage set), in bf16 as its ``Float16Module``
    makes it."""
    from megatron.core.transformer.enums import ModelType

    model.model_type = ModelType.encoder_or_decoder
    if vp_stage is not None:
        model.vp_stage = vp_stage
    return model.bfloat16()


def rank_main(rank: int, world: int, pp: int, steps: int, part: str, models: list[str], recompute: bool, tp: int = 1,
              cp: int = 1, vision_dp: bool = False):  # fmt: skip
    from tests.unit_tests.training.ep_overlap.mcore_cpu import init_megatron, install_cpu_stubs

    install_cpu_stubs()
    init_megatron(2, pp, 2 if pp > 1 else None, tensor=tp, context=cp)
    from tests.functional_tests import vl_support

    vl_support.use_local_specs()
    if part:
        mutate(part)
    return {name: train_arms(name, pp, steps, recompute, tp, cp, vision_dp) for name in models}


def train_arms(
    model_name: str, pp: int, steps: int, recompute: bool = False, tp: int = 1, cp: int = 1, vision_dp: bool = False
) -> dict:
    """One model's two arms on this rank: each microbatch's logged loss and every gradient, per step."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron.bridge.training.ep_overlap.mcore import use_ep_overlap_schedule
    from tests.functional_tests import vl_support

    small = vl_support.small_qwen35_vl_provider if model_name == "qwen35_vl" else vl_support.small_qwen3_vl_provider
    provider = small(layers=2 * pp * pp, seq=SEQ, vocab=VOCAB)
    if model_name == "qwen35_vl":
        provider.mtp_num_layers = 1  # as every Qwen3.5-VL recipe has it: its head reads the multimodal rotary
    if pp > 1:
        provider.pipeline_model_parallel_size, provider.virtual_pipeline_model_parallel_size = pp, 2
        provider.pipeline_dtype = torch.bfloat16
    if tp > 1:  # Megatron-Core's MoE layer needs sequence parallelism with TP
        provider.tensor_model_parallel_size, provider.sequence_parallel = tp, True
    provider.context_parallel_size, provider.vision_dp_when_cp = cp, vision_dp
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    provider.finalize()
    data_rank = parallel_state.get_data_parallel_rank()
    microbatches = 4
    # Both arms are built first: their language models share the provider as their config, which the hook arm's
    # settings change (the vision tower's config is its own, copied when it is built).
    arms = {arm: build_chunks(provider, pp) for arm in ("plain", "hook")}
    provider.batch_p2p_comm, provider.overlap_p2p_comm = False, pp > 1  # gloo: P2P matched in posting order
    if recompute:  # the language layers only, set on the built config as the hook's keyword sets it
        provider.recompute_granularity, provider.recompute_method, provider.recompute_num_layers = "full", "uniform", 1
    out = {}
    for arm, chunks in arms.items():
        if arm == "hook":
            provider.overlap_moe_expert_parallel_comm = True
            replay = ("uniform", 1) if recompute else None
            use_ep_overlap_schedule(chunks, timeout=timedelta(seconds=60), full_recompute=replay)
        optimizer = torch.optim.Adam([p for c in chunks for p in c.parameters()], lr=1e-2)
        named = [(f"chunk{v}.{n}", p) for v, c in enumerate(chunks) for n, p in c.named_parameters()]
        record = {"losses": [], "grads": [], "params": [], "images": 0, "vision_patches": []}
        for chunk in chunks:  # the patches each vision tower call gets (with vision_dp_when_cp, this rank's share)
            if getattr(chunk, "vision_model", None) is not None:
                seen = record["vision_patches"]
                chunk.vision_model.register_forward_pre_hook(
                    lambda module, args, kwargs, seen=seen: seen.append(kwargs["hidden_states"].shape[0]),
                    with_kwargs=True,
                )
        for step in range(steps):
            data = vl_support.step_microbatches(provider, data_rank, step, microbatches, ROWS, SEQ)
            record["images"] += sum(int(mb["visual_inputs"] is not None) for mb in data)
            store = get_forward_backward_func()(
                forward_step_func=vl_forward_step,
                data_iterator=[iter(data) for _ in chunks] if pp > 1 else iter(data),
                model=chunks if pp > 1 else chunks[0],
                num_microbatches=microbatches,
                seq_length=SEQ,
                micro_batch_size=ROWS,
                forward_only=False,
            )
            record["losses"].append([logged["lm loss"].float().tolist() for logged in store])
            record["grads"].append({n: p.grad.float().flatten().tolist() for n, p in named if p.grad is not None})
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            record["params"].append({n: p.detach().float().flatten().tolist() for n, p in named})
        if arm == "hook":
            recorder = chunks[0].build_schedule_plan.recorder
            record["dispatches"] = sum(r.op == "dispatch" for r in recorder.comm)
            record["paired"] = any(r.phase == "paired" for r in recorder.comm)
            record["plan"] = type(chunks[0].build_schedule_plan.chunk).__name__
        out[arm] = record
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tree", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--pp", type=int, default=1, choices=[1, 2])
    parser.add_argument("--tp", type=int, default=1, choices=[1, 2])
    parser.add_argument("--cp", type=int, default=1, choices=[1, 2])
    parser.add_argument("--vision_dp_when_cp", action="store_true", help="with --cp 2: the images split over CP")
    parser.add_argument("--steps", type=int, default=2)
    parts = ["", "vision", "mrope", "mrope-later", "deepstack", "mtp-rotary", "sp-split", "cp-split"]
    parser.add_argument("--mutate", default="", choices=parts)
    parser.add_argument("--models", default="qwen3_vl", help="comma-separated: qwen3_vl, qwen35_vl")
    parser.add_argument("--full_recompute", action="store_true", help="uniform, 1 layer (the hook's keyword)")
    args = parser.parse_args()
    from ep_overlap_lab.multiprocess import run_local_ranks

    arguments = (args.pp, args.steps, args.mutate, args.models.split(","), args.full_recompute, args.tp, args.cp,
                 args.vision_dp_when_cp)  # fmt: skip
    ranks = args.pp * args.tp * max(2, args.cp)  # EP 2 spans the context-parallel pair, or else 2 data-parallel ranks
    outcomes = run_local_ranks(rank_main, ranks, arguments, collective_timeout_s=120)
    args.out.write_text(json.dumps([o.result for o in outcomes]))


if __name__ == "__main__":
    sys.path.insert(1, str(ROOT))  # the tests' CPU stand-ins (tests/...); never src/, which the tree stands for
    main()
