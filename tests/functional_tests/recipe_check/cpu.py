"""Test-only: the CPU substitutions of the recipe check, each named in the row (never product).

bf16 weights (fp8 and fp4 recipes drop to it), Megatron-Core's local layer specs (with the tests' norms that take
sequence parallelism and attention that takes context parallelism, where the layout has them; a local MTP block), the
``alltoall`` dispatcher for ``flex`` (and what only a flex backend reads: its capacity factor, paged stash), no fused
kernels, no CUDA graphs, PEFT adapters not applied. Per family: a hybrid stack's local spec; gated delta net and Mamba
layers with the tests' torch stand-ins for their kernels (``ssm_kernels.py``, installed in each rank before the model
is built, :func:`install_kernels`); a vision-language model's vision tower and specs from ``vl_support.py``.

Each substitution is named in the row with the recipe's own value. Fields that only GPU kernels read (SM counts, graph
warm-up, paged-stash buffer sizes, the checkpoint's id) go back to their defaults: the CPU run never reads them, and
configs that differ only there share one CPU run.
"""

import contextlib
import dataclasses

_FUSIONS = ("moe_grouped_gemm", "moe_permute_fusion", "moe_router_fusion", "gradient_accumulation_fusion",
            "persist_layer_norm", "masked_softmax_fusion", "apply_rope_fusion", "bias_dropout_fusion",
            "bias_activation_fusion", "cross_entropy_loss_fusion", "use_transformer_engine_op_fuser",
            "fused_single_qkv_rope")  # fmt: skip
# Read by GPU kernels and launchers only, never by a CPU step: back to their defaults.
_GPU_ONLY = ("moe_hybridep_num_sms", "moe_hybridep_num_sms_preprocessing", "moe_deepep_num_sms",
             "moe_flex_dispatcher_num_sms", "cuda_graph_warmup_steps", "cuda_graph_scope", "cuda_graph_modules",
             "cuda_graph_use_single_mempool", "external_cuda_graph", "enable_cuda_graph",
             "moe_paged_stash_buffer_size_factor_cuda", "moe_paged_stash_buffer_size_factor_cpu",
             "moe_pad_experts_for_cuda_graph_inference", "hf_model_id", "hf_model_revision", "use_te_rng_tracker",
             "high_priority_a2a_comm_stream", "hetereogenous_dist_checkpoint",
             # read by fused or fp8 kernels only, which the CPU run has none of
             "attention_backend", "cross_entropy_fusion_impl", "fp8_output_proj", "fp8_param",
             "keep_mtp_spec_in_bf16")  # fmt: skip
# Read only with fine-grained activation offloading on, which the CPU run turns off (the plan's offloading runs on CPU
# in tests/unit_tests/training/ep_overlap/test_activation_offloading.py, under a stand-in offload manager).
_OFFLOADING = ("offload_modules", "min_offloaded_tensor_size", "fine_grained_offloading_max_inflight_offloads")


def family_of(model) -> str:
    """How the CPU run builds the model: ``vision_language`` (the Qwen3-VL and Qwen3.5-VL providers, whose model the
    plan runs), ``hybrid``, ``gdn`` or ``gpt``."""
    from megatron.bridge.training.ep_overlap.mcore.refusals import _QWEN3_VL_PROVIDERS

    if {cls.__name__ for cls in type(model).__mro__} & _QWEN3_VL_PROVIDERS:
        return "vision_language"
    if getattr(model, "hybrid_layer_pattern", None):
        return "hybrid"
    if getattr(model, "experimental_attention_variant", None) == "gated_delta_net":
        return "gdn"
    return "gpt"


def _precision_name(mixed, model) -> str:
    """The recipe's precision in a few words: its preset's name, or what its ``MixedPrecisionConfig`` turns on."""
    if isinstance(mixed, str) or mixed is None:
        return mixed or ("bf16" if model.bf16 else "fp32")
    words = [getattr(mixed, "name", None)] if getattr(mixed, "name", None) else []
    if not words:
        words = ["bf16" if mixed.bf16 else "fp16" if mixed.fp16 else "fp32"]
        words += [
            f"{kind} {getattr(mixed, kind + '_recipe', '')}".strip()
            for kind in ("fp8", "fp4")
            if getattr(mixed, kind, None)
        ]
    return " ".join(words)


def on_cpu(cfg) -> list[str]:
    """The CPU substitutions, in place; returns them as the row's words."""
    import torch

    model, said = cfg.model, []
    precision = _precision_name(cfg.mixed_precision, model)
    low = bool(model.fp8 or getattr(model, "fp4", None)) or "fp8" in str(precision) or "fp4" in str(precision)
    if low or "bf16" not in str(precision):
        said.append(f"precision {precision} -> bf16")
    cfg.mixed_precision = None
    if low:  # what only fp8/fp4 takes (Megatron-Core asserts it without them)
        for name in ("moe_router_padding_for_quantization", "moe_router_padding_for_fp8"):
            if getattr(model, name, False):
                setattr(model, name, False)
                said.append(f"{name} -> False (fp8/fp4 only)")
    model.fp8 = model.fp4 = None
    model.bf16, model.fp16, model.params_dtype = True, False, torch.bfloat16
    model.pipeline_dtype = torch.bfloat16 if model.pipeline_model_parallel_size > 1 else None
    said += _dispatch(model) + _specs(model)
    if model.context_parallel_size > 1:
        said.append("attention -> tests' context-parallel attention")
    if getattr(cfg, "peft", None) is not None:
        said.append(f"{type(cfg.peft).__name__} not applied (full weights train)")
    # A repeated MTP layer with delayed wgrad is bitwise only with the fusion (rule delay_wgrad_repeated_mtp_unfused):
    # there it runs through the tests' torch twin of the kernel, as on GPU; elsewhere it goes with the other fusions.
    fused_wgrad = bool(getattr(model, "gradient_accumulation_fusion", False)) and _repeated_mtp(model)
    if fused_wgrad:
        said.append("gradient accumulation fusion -> tests' torch stand-in (each use into main_grad)")
    for name in _FUSIONS:
        if hasattr(model, name) and not (fused_wgrad and name == "gradient_accumulation_fusion"):
            setattr(model, name, False)
    if "moe_act" in (model.recompute_modules or []):  # Megatron-Core recomputes it only inside grouped GEMMs
        model.recompute_modules = [m for m in model.recompute_modules if m != "moe_act"]
        said.append("recompute of moe_act dropped (it needs grouped GEMMs)")
    if getattr(model, "dsa_kernel_backend", "none") != "none":
        said.append(f"sparse attention kernels {model.dsa_kernel_backend} -> none (torch)")
        model.dsa_kernel_backend = "none"
    if model.cuda_graph_impl not in (None, "none"):
        said.append(f"CUDA graphs {model.cuda_graph_impl} -> none")
    model.cuda_graph_impl = "none"
    if getattr(model, "fine_grained_activation_offloading", False):  # Bridge's validate wants Transformer Engine
        said.append("fine-grained activation offloading -> off (Bridge takes it with Transformer Engine layers only)")
        model.fine_grained_activation_offloading = False
    if getattr(cfg.ddp, "use_megatron_fsdp", False):  # the loop's small config wraps with Megatron DDP
        said.append("Megatron-FSDP -> Megatron DDP (FSDP under the plan: test_megatron_fsdp.py)")
    if getattr(model, "init_model_with_meta_device", False):  # only Megatron-FSDP materializes a meta model
        said.append("meta-device init -> off")
        model.init_model_with_meta_device = False
    defaults = {f.name: f for f in dataclasses.fields(model)}
    for name in _GPU_ONLY + _OFFLOADING:
        field = defaults.get(name)
        if field is not None and field.default is not dataclasses.MISSING:
            setattr(model, name, field.default)
        elif field is not None and field.default_factory is not dataclasses.MISSING:
            setattr(model, name, field.default_factory())
    model.use_cpu_initialization, model.batch_p2p_comm = True, False
    model.attention_dropout = model.hidden_dropout = 0.0
    return said


def _repeated_mtp(model) -> bool:
    return bool(getattr(model, "mtp_use_repeated_layer", False)) and (getattr(model, "mtp_num_layers", None) or 0) > 1


def _dispatch(model) -> list[str]:
    """The alltoall dispatcher for flex (its backends are GPU kernels), and what only they read."""
    said = []
    if model.moe_token_dispatcher_type == "flex":
        said.append(f"dispatcher flex ({model.moe_flex_dispatcher_backend}) -> alltoall")
        model.moe_token_dispatcher_type = "alltoall"
    if getattr(model, "moe_paged_stash", False):
        said.append("paged stash -> off (it pages Transformer Engine's fused experts)")
        model.moe_paged_stash = False
    if getattr(model, "moe_expert_rank_capacity_factor", None) is not None:
        model.moe_expert_rank_capacity_factor = None  # a HybridEP budget: no meaning for alltoall
    if getattr(model, "moe_ncclep_static_shape", False):
        model.moe_ncclep_static_shape = False
    model.moe_flex_dispatcher_backend = "deepep"  # the default: a backend means nothing to alltoall
    return said


def _specs(model) -> list[str]:
    """Megatron-Core's local modules for the family, with the kernels' stand-ins where its layers need them."""
    family, sp = family_of(model), ", SP norms" if model.sequence_parallel else ""
    model.transformer_impl = "local"
    if family == "vision_language":  # vl_support substitutes the tower's and the language model's specs in the rank
        said = ["vision tower shrunk, its and the language model's specs -> local modules (vl_support)"]
        if getattr(model, "mtp_num_layers", None):  # Qwen3.5-VL's MTP block comes from Bridge's GPT function
            import megatron.bridge.models.gpt_provider as gpt_provider

            model.transformer_layer_spec = recipe_spec
            gpt_provider.mtp_block_spec = local_mtp_block_spec  # in this worker process only
            said.append("MTP block -> local modules")
        if model.virtual_pipeline_model_parallel_size and not _passes_vp_stage(model):
            said.append("Qwen3-VL MoE provider given vp_stage (0.6.2 drops it: with virtual stages the recipe fails "
                        "on any hardware; upstream bug)")  # fmt: skip
        return said
    if family == "hybrid":
        model.hybrid_stack_spec = recipe_hybrid_spec
        kernels = _kernel_words(model)
        return ["hybrid stack spec -> Megatron-Core local" + sp + kernels]
    model.transformer_layer_spec = recipe_spec
    said = ["layer spec -> Megatron-Core local" + sp + _kernel_words(model)]
    if getattr(model, "multi_latent_attention", False) and model.q_lora_rank is None and model.qk_layernorm:
        said.append("MLA's query norm and projection -> tests' norm + linear (Transformer Engine fuses them)")
    if getattr(model, "mtp_num_layers", None):
        import megatron.bridge.models.gpt_provider as gpt_provider

        gpt_provider.mtp_block_spec = local_mtp_block_spec  # in this worker process only
        said.append("MTP block -> local modules")
    return said


def _kernel_words(model) -> str:
    kernels = []
    if getattr(model, "moe_latent_size", None) or getattr(model, "experimental_attention_variant", None) == "dsa":
        kernels.append("duplicated linears (latent MoE, sparse attention indexer)")
    pattern = getattr(model, "hybrid_layer_pattern", None) or ""
    if "M" in pattern:
        kernels.append("mamba-ssm kernels")
    if "G" in pattern or getattr(model, "experimental_attention_variant", None) == "gated_delta_net":
        kernels.append("gated delta net kernels")
    return f"; {' and '.join(kernels)} -> tests' torch stand-ins" if kernels else ""


def install_rank_stand_ins(model) -> None:
    """In a rank, before the model is built: the torch stand-ins of the kernels its layers call, what Megatron-Core
    reads of Transformer Engine's fp8 state in a checkpointed norm (nothing is fp8 here: not fp8, no recompute
    phase), and the vp_stage Bridge's Qwen3-VL MoE provider drops."""
    from megatron.core.tensor_parallel import random

    from tests.unit_tests.training.ep_overlap.ssm_kernels import install_gdn_kernels, install_mamba_kernels

    words = _kernel_words(model)
    if getattr(model, "gradient_accumulation_fusion", False):  # on_cpu kept it: the kernel's torch twin
        from tests.unit_tests.training.ep_overlap.fused_wgrad import install_fused_wgrad

        install_fused_wgrad()
    if "mamba-ssm" in words:
        install_mamba_kernels()
    if "gated delta net" in words or family_of(model) == "vision_language":
        install_gdn_kernels()
    if getattr(model, "moe_latent_size", None) or getattr(model, "experimental_attention_variant", None) == "dsa":
        from tests.unit_tests.training.ep_overlap.family_models import install_latent_projections

        install_latent_projections()  # Transformer Engine's duplicated linear, for the latent MoE and DSA's indexer
    if not hasattr(random, "FP8GlobalStateManager"):  # imported from Transformer Engine, absent here
        random.FP8GlobalStateManager = type("NoFP8", (), {"is_fp8_enabled": staticmethod(lambda: False)})
    if not hasattr(random, "activation_recompute_forward"):  # Transformer Engine's fp8 recompute phase marker
        random.activation_recompute_forward = lambda **_: contextlib.nullcontext()
    if family_of(model) == "vision_language" and not _passes_vp_stage(model):
        _provide_with_vp_stage(type(model))


def _passes_vp_stage(model) -> bool:
    """Whether the VL provider passes ``vp_stage`` on (Qwen3.5-VL's does; Qwen3-VL's do not)."""
    return "35" in type(model).__name__


def _provide_with_vp_stage(provider_class) -> None:
    """Bridge 0.6.2's Qwen3-VL MoE provider builds ``Qwen3VLModel`` without the ``vp_stage`` it is given (Megatron-
    Core's block then refuses to build under virtual stages): here it is passed on, in this process."""
    import functools
    import sys

    stock = provider_class.provide
    module = sys.modules[stock.__module__]

    def provide(self, pre_process=None, post_process=None, vp_stage=None):
        built = module.Qwen3VLModel
        module.Qwen3VLModel = functools.partial(built, vp_stage=vp_stage)
        try:
            return stock(self, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
        finally:
            module.Qwen3VLModel = built

    if not getattr(stock, "passes_vp_stage", False):
        provide.passes_vp_stage = True
        provider_class.provide = provide


def recipe_spec(config, vp_stage=None):
    """Megatron-Core's local decoder block spec (MLA's core attention made to build, no query norm without a query
    LoRA rank), with the tests' norms that
    take sequence parallelism and attention that takes context parallelism where the layout has them; a gated delta
    net config's local twin of Bridge's spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from tests.unit_tests.training.ep_overlap.cp_attention import with_context_parallel_attention
    from tests.unit_tests.training.ep_overlap.mcore_models import (
        local_gdn_decoder_block_spec,
        local_mla_core_attention,
    )
    from tests.unit_tests.training.ep_overlap.sp_norm import with_sequence_parallel_norms

    if config.experimental_attention_variant == "gated_delta_net":  # its norms are zero-centred: not the SP ones
        return local_gdn_decoder_block_spec(config, vp_stage)
    if config.experimental_attention_variant == "dsa":
        from tests.unit_tests.training.ep_overlap.family_models import dsa_block_spec

        spec = dsa_block_spec(config, vp_stage)
        return _zero_centered(config, with_sequence_parallel_norms(spec) if config.sequence_parallel else spec)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)
    if config.multi_latent_attention:
        from megatron.core.transformer.identity_op import IdentityOp

        from tests.unit_tests.training.ep_overlap.sp_norm import use_norm_linear_for_local_mla

        use_norm_linear_for_local_mla()  # named in the row (_specs)

        for layer in spec.layer_specs:
            attention = layer.submodules.self_attention.submodules
            attention.core_attention = local_mla_core_attention()
            if config.q_lora_rank is None:  # no query LoRA: a query norm fused into the projection, if any
                attention.q_layernorm = IdentityOp
    if config.context_parallel_size > 1:
        with_context_parallel_attention(spec)
    return _zero_centered(config, with_sequence_parallel_norms(spec) if config.sequence_parallel else spec)


def recipe_hybrid_spec(config):
    """Megatron-Core's local hybrid stack spec (``mcore_models.local_hybrid_stack_spec``) with, as
    :func:`recipe_spec` gives a GPT block, the tests' norms that take sequence parallelism (each layer kind's, the MTP
    block's, the stack's final norm) and attention that takes context parallelism, where the layout has them."""
    import megatron.core.models.hybrid.hybrid_block as hybrid_block
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from tests.unit_tests.training.ep_overlap.cp_attention import ContextParallelAttention
    from tests.unit_tests.training.ep_overlap.mcore_models import LocalNorm, local_hybrid_stack_spec

    spec = local_hybrid_stack_spec(config)
    kinds = [getattr(spec.submodules, name, None) for name in _HYBRID_LAYERS]
    kinds = [kind for kind in kinds if isinstance(kind, ModuleSpec)]  # a kind the stack lacks is an identity
    attentions = [getattr(getattr(kind.submodules, "self_attention", None), "submodules", None) for kind in kinds]
    if config.context_parallel_size > 1:
        for attention in attentions:
            if attention is not None and hasattr(attention, "core_attention"):
                attention.core_attention = ContextParallelAttention
    if not config.sequence_parallel:
        return spec
    hybrid_block.TENorm = NormTakingSP  # the stack's final norm, which it names directly; in this process only
    mtp = spec.submodules.mtp_block_spec
    holders = [kind.submodules for kind in kinds] + attentions
    for holder in holders + ([layer.submodules for layer in mtp.submodules.layer_specs] if mtp is not None else []):
        for name in _NORMS + ("norm",):  # a Mamba layer's norm is ``norm``; the mixers' own norms stay
            if holder is not None and getattr(holder, name, None) in (LocalNorm, WrappedTorchNorm):
                setattr(holder, name, NormTakingSP)
    return spec


_HYBRID_LAYERS = ("attention_layer", "mla_layer", "mlp_layer", "moe_layer", "mamba_layer", "gdn_layer")


class NormTakingSP:
    """The tests' norm that takes sequence parallelism, zero-centred where the config says so: ``LocalNorm`` (in
    ``mcore_models``) with its weights carrying ``sequence_parallel``."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        from tests.unit_tests.training.ep_overlap.sp_norm import SequenceParallelNorm

        make = ZeroCenteredNormTakingSP if config.layernorm_zero_centered_gamma else SequenceParallelNorm
        return make(config, hidden_size, eps)


class ZeroCenteredNormTakingSP:
    """Transformer Engine's norm as it reads ``layernorm_zero_centered_gamma`` (the weight starts at zero and scales
    by ``1 + weight``: ``mcore_models.ZeroCenteredNorm``), its weights carrying ``sequence_parallel`` as the SP norms'
    do. Megatron-Core's local norm refuses the field; the tests' SP norm would ignore it."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        from tests.unit_tests.training.ep_overlap.mcore_models import ZeroCenteredNorm

        norm = ZeroCenteredNorm(hidden_size, eps, rms=config.normalization == "RMSNorm")
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


_NORMS = ("layer_norm", "input_layernorm", "pre_mlp_layernorm", "q_layernorm", "k_layernorm", "kv_layernorm",
          "enorm", "hnorm")  # fmt: skip


def _zero_centered(config, spec):
    """``spec`` (a block spec, or an MTP block spec) with each torch norm zero-centred where ``config`` asks for it
    (Step-3.5); identities stay identities."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from tests.unit_tests.training.ep_overlap.sp_norm import SequenceParallelNorm

    if spec is None or not config.layernorm_zero_centered_gamma:
        return spec
    holders = [spec]
    for layer in spec.layer_specs:
        holders.append(layer.submodules)
        holders.append(getattr(getattr(layer.submodules, "self_attention", None), "submodules", None))
    for holder in holders:
        for name in _NORMS:
            if holder is not None and getattr(holder, name, None) in (WrappedTorchNorm, SequenceParallelNorm):
                setattr(holder, name, ZeroCenteredNormTakingSP)
    return spec


def local_mtp_block_spec(config, vp_stage=None):
    """Bridge's ``gpt_provider.mtp_block_spec`` with Megatron-Core's local modules (Bridge's asks for Transformer
    Engine's), its norms taking sequence parallelism where the layout has it."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    from tests.unit_tests.training.ep_overlap.mcore_models import local_gdn_mtp_block_spec
    from tests.unit_tests.training.ep_overlap.sp_norm import SequenceParallelNorm

    if not getattr(config, "mtp_num_layers", None):
        return None
    if config.experimental_attention_variant == "gated_delta_net":
        return local_gdn_mtp_block_spec(config, vp_stage)
    layers = recipe_spec(config, vp_stage).layer_specs
    # A stage without decoder layers: the model's last layer's kind, as Bridge derives it; with virtual stages, the
    # rank's latest earlier stage that has layers (the last decoder layers sit just before the MTP layer).
    for earlier in reversed(range(vp_stage or 0)) if not layers else ():
        layers = recipe_spec(config, earlier).layer_specs
        if layers:
            break
    if not layers:
        layers = recipe_spec(config, None).layer_specs
    block = get_gpt_mtp_block_spec(config, layers[-1], use_transformer_engine=False, vp_stage=vp_stage)
    for layer in block.layer_specs if block is not None and config.sequence_parallel else ():  # None: no MTP here
        for name in ("enorm", "hnorm", "layer_norm"):
            if getattr(layer.submodules, name, None) is not None:
                setattr(layer.submodules, name, SequenceParallelNorm)
    return _zero_centered(config, block)
