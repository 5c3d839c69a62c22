"""Test-only: Megatron-Bridge 0.6.2's Qwen3-VL and Qwen3.5-VL models, small, on CPU ranks, and their data.

Run in the stock-Bridge scratch interpreter (``stock_bridge.py``), never by product code. Bridge's VL providers build
Transformer Engine's layer specs themselves, whatever a recipe's ``transformer_layer_spec`` says, and the VL model
builds its vision tower from Transformer Engine's ViT spec and patch-merger modules; on a host without Transformer
Engine these become Megatron-Core's local modules (:func:`use_local_specs`, in this process only), with a core
attention that runs the vision tower's packed frames (:class:`FrameAttention`). What else runs is Bridge's and
Megatron-Core's code.

For the recipe check (``recipe_check/worker.py``), given the ``ConfigContainer`` of one arm that a Qwen3-VL or
Qwen3.5-VL recipe built, its language model already shrunk and put on CPU by the check::

    from tests.functional_tests import vl_support

    vl = vl_support.for_recipe(cfg)  # the vision tower shrunk, the local specs substituted (this process)
    # then Bridge's train(vl.forward_step, ..., vl.data(data_parallel_rank, steps, microbatches_per_step), ...)

or, on each rank, ``vl_bridge_loop.bridge_train_vl(cfg, steps)``, which calls ``for_recipe`` and runs Bridge's setup
steps and ``train()`` as ``stock_bridge_loop.bridge_train`` does, returning a record with the same keys.
``for_recipe`` returns a :class:`VLRun`: ``forward_step`` (Bridge's ``qwen3_vl_step.forward_step``: stock 0.6.2's
hands the plan no images, so as a plugin the hook arm is refused on its first microbatch with images, naming the
patch; the patched one trains) and ``data``, a factory of one rank's microbatches in the format
``qwen3_vl_step.get_batch`` reads (``tokens``, ``labels``, ``loss_mask``, ``position_ids``, ``attention_mask`` None,
``visual_inputs`` a ``GenericVisualInputs`` or None): every step mixes rows with images and text-only rows (two images
in a row where the sequence has room for them: 7 tokens an image). Call it before the model is built, in the
process that builds it (or in the parent before the ranks fork), after ``install_cpu_stubs``; in a worker process,
never in pytest's own (the gated delta net's kernel stand-ins reload Megatron-Core modules). What it changes in
``cfg.model``: the vision tower (:data:`VISION`; as many deepstack features as the recipe's, at most the first
chunk's layers), the image, video and vision start/end token ids (the top four ids of the shrunk vocabulary) and
``language_max_sequence_length`` (the sequence length); nothing of the language model, its freezing included. What
the plan refuses of a recipe stays refused by name (sequence and context parallelism run: the tests' norms and
attention take them). For Qwen3.5-VL, a ``linear_attention_freq`` above the layers the
check keeps leaves no attention layer in the shrunk model (2 keeps one of each).
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

# The vision tower's shape: patches of 2 x 2 pixels over 2 frames (a still image repeats its frame), 2 x 2 patches
# merged into one language token; a 4 x 4 image is 16 patches, 4 tokens.
VISION = dict(depth=2, hidden_size=16, num_heads=2, intermediate_size=32, patch_size=2, temporal_patch_size=2,
              in_channels=3, spatial_merge_size=2, num_position_embeddings=16)  # fmt: skip
IMAGE_GRID = (1, 4, 4)  # (frames, patch rows, patch columns) of each test image
# Special tokens at the top of the small vocabulary; text tokens are drawn below them.
SPECIAL = 4


class FrameAttention(DotProductAttention):
    """The vision tower's core attention on CPU: every frame (a ``cu_seqlens_q`` segment of the packed patches)
    attends to all of itself and nothing else, as Transformer Engine's attention runs the ViT's THD input. Query,
    key and value arrive ``[patches, heads, head_dim]``; the output is ``[patches, heads * head_dim]``."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):  # fmt: skip
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        frames = [
            super(FrameAttention, self).forward(*(t[start:end].unsqueeze(1) for t in (query, key, value)), None)
            for start, end in zip(bounds[:-1], bounds[1:])
        ]
        return torch.cat(frames, dim=0).squeeze(1)


def local_layer_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False, fp8=False, **_):
    """Stands for ``get_gpt_layer_with_transformer_engine_spec`` in Bridge's Qwen3-VL provider: Megatron-Core's local
    layer (its experts sequential: grouped GEMMs are Transformer Engine's), its norms the tests' norm that takes
    sequence parallelism as Transformer Engine's does (``sp_norm.py``; torch's norm without it), its core attention
    the tests' one that takes context parallelism where this process has it (``cp_attention.py``: the provider passes
    no config)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from tests.unit_tests.training.ep_overlap.cp_attention import ContextParallelAttention
    from tests.unit_tests.training.ep_overlap.sp_norm import SequenceParallelNorm

    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_layernorm)
    if parallel_state.model_parallel_is_initialized() and parallel_state.get_context_parallel_world_size() > 1:
        spec.submodules.self_attention.submodules.core_attention = ContextParallelAttention
    for holder in (spec.submodules, spec.submodules.self_attention.submodules):
        for name in ("input_layernorm", "pre_mlp_layernorm", "q_layernorm", "k_layernorm"):
            if getattr(holder, name, None) is WrappedTorchNorm:
                setattr(holder, name, SequenceParallelNorm)
    return spec


def local_vision_layer_spec():
    """Stands for ``get_vit_layer_with_transformer_engine_spec``: Megatron-Core's local ViT layer, with
    :class:`FrameAttention`."""
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec

    spec = get_vit_layer_with_local_spec()
    spec.submodules.self_attention.submodules.core_attention = FrameAttention
    return spec


def local_gdn_block_spec(config, vp_stage=None, pp_rank=None):
    """Stands for ``get_transformer_block_with_experimental_attention_variant_spec`` in Bridge's Qwen3.5-VL provider
    (Transformer Engine only): the tests' local gated-delta-net block (``mcore_models.local_gdn_decoder_block_spec``);
    Bridge then makes its standard attention layers ``Qwen3VLSelfAttention``, as it does with the real one; their core
    attention takes context parallelism where the config has it (``cp_attention.py``)."""
    from tests.unit_tests.training.ep_overlap.cp_attention import with_context_parallel_attention
    from tests.unit_tests.training.ep_overlap.mcore_models import local_gdn_decoder_block_spec

    spec = local_gdn_decoder_block_spec(config, vp_stage, pp_rank)
    return with_context_parallel_attention(spec) if config.context_parallel_size > 1 else spec


def local_vl_mtp_block_spec(config, vp_stage=None):
    """Stands for Bridge's ``gpt_provider.mtp_block_spec``: the recipe check's local MTP block, its layer's core
    attention taking context parallelism where the config has it (``cp_attention.py``)."""
    from tests.functional_tests.recipe_check.cpu import local_mtp_block_spec
    from tests.unit_tests.training.ep_overlap.cp_attention import with_context_parallel_attention

    block = local_mtp_block_spec(config, vp_stage)
    if block is not None and config.context_parallel_size > 1:
        layers = [layer.submodules.mtp_model_layer for layer in block.layer_specs]
        with_context_parallel_attention(SimpleNamespace(layer_specs=layers))
    return block


def use_local_specs() -> None:
    """Bridge's VL model and providers build Megatron-Core's local modules where they name Transformer Engine's (this
    process only): the language layers (Qwen3-VL's, and Qwen3.5-VL's gated-delta-net block), the ViT layers, the
    patch mergers' norm and linears; and the gated delta net's kernels get their CPU stand-ins (``ssm_kernels.py``).
    Call it before the model is built."""
    import megatron.bridge.models.gpt_provider as gpt_provider
    import megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model as vl_model
    import megatron.bridge.models.qwen_vl.qwen3_vl_provider as qwen3_vl_provider
    import megatron.bridge.models.qwen_vl.qwen35_vl_provider as qwen35_vl_provider
    import megatron.core.transformer.transformer_block as transformer_block
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from tests.unit_tests.training.ep_overlap.sp_norm import SequenceParallelNorm
    from tests.unit_tests.training.ep_overlap.ssm_kernels import install_gdn_kernels

    install_gdn_kernels()
    qwen3_vl_provider.get_gpt_layer_with_transformer_engine_spec = local_layer_spec
    # The final norm of a block built from one layer spec (Qwen3-VL's language block): as the layers' norms.
    transformer_block.LayerNormImpl = SequenceParallelNorm
    qwen35_vl_provider.get_transformer_block_with_experimental_attention_variant_spec = local_gdn_block_spec
    gpt_provider.mtp_block_spec = local_vl_mtp_block_spec  # Qwen3.5-VL's MTP block, which Bridge builds with TE's
    for module in (vl_model, qwen35_vl_provider):  # the VL model builds its vision tower; Qwen3.5's provider too
        module.get_vit_layer_with_transformer_engine_spec = local_vision_layer_spec
        module.TENorm, module.TEColumnParallelLinear, module.TERowParallelLinear = (
            WrappedTorchNorm,
            ColumnParallelLinear,
            RowParallelLinear,
        )


def first_chunk_layers(provider) -> int:
    """The language layers on the first pipeline chunk (an even split over stages and virtual stages)."""
    chunks = (provider.pipeline_model_parallel_size or 1) * (provider.virtual_pipeline_model_parallel_size or 1)
    return provider.num_layers // chunks


def shrink_vision(provider, deepstack: int | None = None) -> None:
    """The provider's vision tower at CPU size (:data:`VISION`, its output the language model's width), with
    ``deepstack`` deepstack features (None: as many as it has, at most the first chunk's layers, where the language
    model adds them: Qwen3-VL has some, Qwen3.5-VL none), and its special tokens moved inside the (shrunk)
    vocabulary."""
    vision = provider.vision_config
    if deepstack is None:
        deepstack = min(len(getattr(vision, "deepstack_visual_indexes", None) or ()), first_chunk_layers(provider))
    for name, value in VISION.items():
        setattr(vision, name, value)
    vision.out_hidden_size = provider.hidden_size
    vision.deepstack_visual_indexes = list(range(deepstack))  # vision layers 0, 1, ... (its depth is 2)
    top = provider.vocab_size
    provider.vision_start_token_id, provider.vision_end_token_id = top - 4, top - 3
    provider.image_token_id, provider.video_token_id = top - 2, top - 1
    provider.spatial_merge_size = vision.spatial_merge_size


def image_tokens() -> int:
    """Language tokens one test image takes."""
    frames, rows, cols = IMAGE_GRID
    return frames * rows * cols // VISION["spatial_merge_size"] ** 2


def images_per_row(seq: int) -> int:
    """How many test images fit in a row of ``seq`` tokens: each takes its tokens, a vision start and end, and one
    text token after it; a row starts with a text token."""
    return seq // (image_tokens() + 3)


def microbatch(gen: torch.Generator, provider, rows: int, seq: int, images: list[int]) -> dict:
    """One microbatch in ``qwen3_vl_step.get_batch``'s format: ``rows`` sequences of ``seq`` tokens; row ``r`` holds
    ``images[r]`` images (as many as fit: :func:`images_per_row`), each a vision start, the image's tokens and a vision
    end, after a text token. Labels are the next tokens; image tokens do not count in the loss."""
    from megatron.bridge.training.utils.visual_inputs import GenericVisualInputs

    text = provider.vocab_size - SPECIAL
    tokens = torch.randint(0, text, (rows, seq + 1), generator=gen)
    per_image = image_tokens()
    images = [min(count, images_per_row(seq)) for count in images]
    for r, count in enumerate(images):
        for k in range(count):
            start = 1 + k * (per_image + 3)
            tokens[r, start] = provider.vision_start_token_id
            tokens[r, start + 1 : start + 1 + per_image] = provider.image_token_id
            tokens[r, start + 1 + per_image] = provider.vision_end_token_id
    loss_mask = (tokens[:, 1:] != provider.image_token_id).float()
    total = sum(images)
    patches = IMAGE_GRID[0] * IMAGE_GRID[1] * IMAGE_GRID[2]
    features = VISION["in_channels"] * VISION["temporal_patch_size"] * VISION["patch_size"] ** 2
    visual = None
    if total:
        visual = GenericVisualInputs(
            pixel_values=torch.randn(total * patches, features, generator=gen),
            image_grid_thw=torch.tensor([IMAGE_GRID] * total),
        )
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": loss_mask,
        "position_ids": torch.arange(seq)[None].expand(rows, seq).contiguous(),
        "attention_mask": None,
        "visual_inputs": visual,
    }


# Each step mixes microbatches with images (one row with two, where two fit) and text-only ones.
IMAGE_PATTERN = ([1, 0], [0, 0], [2, 1], [0, 1])


def step_microbatches(provider, data_rank: int, step: int, count: int, rows: int, seq: int) -> list[dict]:
    """One step's ``count`` microbatches of one data-parallel rank (the stages of a pipeline read the same)."""
    gen = torch.Generator().manual_seed(1000 * step + data_rank)
    return [
        microbatch(gen, provider, rows, seq, [IMAGE_PATTERN[i % len(IMAGE_PATTERN)][r % 2] for r in range(rows)])
        for i in range(count)
    ]


@dataclass
class VLRun:
    """What Bridge's ``train()`` needs for a VL recipe's data on CPU (see the module docstring)."""

    forward_step: Callable
    data: Callable[[int, int, int], Iterator[dict]]  # (data-parallel rank, steps, microbatches per step)


def for_recipe(cfg, deepstack: int | None = None) -> VLRun:
    """The VL parts of a recipe's ``cfg`` at CPU size (its language model already shrunk): the vision tower shrunk,
    the local specs in this process, the microbatches' sequence length the model's; returns the forward step and the
    data factory (:class:`VLRun`)."""
    from megatron.bridge.models.qwen_vl.qwen3_vl_step import forward_step

    model = cfg.model
    shrink_vision(model, deepstack)
    use_local_specs()
    seq, rows = model.seq_length, cfg.train.micro_batch_size
    model.language_max_sequence_length = seq  # the plan's attention mask is made for it

    def data(data_rank: int, steps: int, microbatches: int) -> Iterator[dict]:
        return iter(
            [mb for step in range(steps) for mb in step_microbatches(model, data_rank, step, microbatches, rows, seq)]
        )

    return VLRun(forward_step=forward_step, data=data)


def small_qwen3_vl_provider(layers: int, seq: int, vocab: int, experts: int = 4, ep: int = 2):
    """Bridge's Qwen3-VL MoE provider as its ``Qwen3VLMoEBridge`` makes it from the model's Hugging Face config (here
    a small one: the hub is not reached), for CPU: bf16, no fused kernels, the vision tower shrunk."""
    from megatron.bridge.models.qwen_vl.qwen3_vl_bridge import Qwen3VLMoEBridge
    from transformers import Qwen3VLMoeConfig

    text = dict(num_hidden_layers=layers, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_attention_heads=2, num_key_value_heads=2, head_dim=16, num_experts=experts,
                num_experts_per_tok=2, vocab_size=vocab, max_position_embeddings=seq,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                                 "mrope_interleaved": True})  # fmt: skip
    config = Qwen3VLMoeConfig(text_config=text, vision_config=dict(VISION, out_hidden_size=32))
    provider = Qwen3VLMoEBridge().provider_bridge(SimpleNamespace(config=config))
    return on_cpu(provider, seq, vocab, ep, deepstack=2)


def small_qwen35_vl_provider(layers: int, seq: int, vocab: int, experts: int = 4, ep: int = 2):
    """Bridge's Qwen3.5-VL MoE provider as its ``Qwen35VLMoEBridge`` makes it from a small Hugging Face config: gated
    delta net and gated attention layers alternating, a gated shared expert, zero-centered norms, partial multimodal
    rotary positions, no deepstack; for CPU as :func:`small_qwen3_vl_provider`."""
    from megatron.bridge.models.qwen_vl.qwen35_vl_bridge import Qwen35VLMoEBridge
    from transformers import Qwen3_5MoeConfig

    text = dict(num_hidden_layers=layers, hidden_size=32, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                linear_num_value_heads=4, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                num_experts=experts, num_experts_per_tok=2, vocab_size=vocab, max_position_embeddings=seq,
                layer_types=["linear_attention", "full_attention"] * (layers // 2),
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})  # fmt: skip
    config = Qwen3_5MoeConfig(text_config=text, vision_config=dict(VISION, out_hidden_size=32))
    provider = Qwen35VLMoEBridge().provider_bridge(SimpleNamespace(config=config))
    provider.mrope_section, provider.mtp_num_layers = [2, 1, 1], None  # Bridge reads the section from rope_scaling
    # (mtp_num_layers: a caller sets 1, as the recipes do, before finalize)
    return on_cpu(provider, seq, vocab, ep, deepstack=0)


def on_cpu(provider, seq: int, vocab: int, ep: int, deepstack: int):
    """``provider`` for these tests on CPU: the vision tower shrunk, bf16, no fused kernels, no auxiliary loss,
    nothing frozen (Bridge's Qwen3-VL MoE provider freezes the language model and the vision tower by default)."""
    shrink_vision(provider, deepstack)
    provider.freeze_language_model = provider.freeze_vision_model = provider.freeze_vision_projection = False
    for name, value in dict(
        seq_length=seq, language_max_sequence_length=seq, make_vocab_size_divisible_by=vocab,
        expert_model_parallel_size=ep, moe_grouped_gemm=False, moe_permute_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, cross_entropy_loss_fusion=False,
        use_cpu_initialization=True, bf16=True, params_dtype=torch.bfloat16, moe_aux_loss_coeff=0.0,
        moe_router_load_balancing_type="none", attention_dropout=0.0, hidden_dropout=0.0,
    ).items():  # fmt: skip
        setattr(provider, name, value)
    return provider
