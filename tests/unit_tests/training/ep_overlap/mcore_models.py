"""Test-only: the Megatron-Core models the adapter tests build, from local (non-Transformer-Engine) specs, for CPU.

:class:`McoreCase` and :func:`build_gpt`: a ``GPTModel``. :class:`HybridCase` and :func:`build_hybrid`: a
``HybridModel``. Megatron-Core ships only a Transformer Engine spec for ``HybridModel`` (``hybrid_stack_spec``); this
one takes the attention (``*``), MLA (``+``), MLP (``-``) and MoE (``E``) parts of ``get_gpt_layer_local_spec()``,
and the stack's final norm (Transformer Engine's ``TENorm``, hard-wired in ``HybridStack``) becomes the local spec's
norm; a pattern's MTP part (after ``/``) gets the MTP block with local norms and projection. Megatron-Core 0.19's local
MLA spec (``+``, and ``McoreCase.mla``) does not build as shipped (its ``DotProductAttention`` takes no
``k_channels``): here its core attention takes MLA's head sizes. Left to the GPU check: Mamba (``M``) and GDN (``G``)
need their CUDA kernels. Build after ``install_cpu_stubs`` (on CPU).
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class McoreCase:
    world: int = 2
    bf16: bool = False
    topk: int = 2
    layer_freq: tuple = (1, 1)
    delay_wgrad: bool = False
    microbatches: int = 4
    steps: int = 2
    device: str = "cpu"
    rope: bool = False
    yarn: bool = False  # YaRN rotary positions, scaled as Bridge's GPT-OSS provider scales them
    expert_bias: bool = False  # sigmoid scores with aux-loss-free load balancing
    mtp: bool = False  # one multi-token prediction layer
    tied: bool = False  # share_embeddings_and_output_weights
    dispatcher: str = "alltoall"  # "flex": Megatron-Core's flex dispatcher, on CPU over fake_deepep's gloo functions
    flex_backend: str = "deepep"  # with "flex": "deepep" or "hybridep"
    mla: bool = False  # multi-latent attention (DeepSeek-V3's), with RMSNorm and its own (yarn) rotary embedding
    recompute: tuple = ()  # selective recompute_modules
    full_recompute: tuple | None = None  # (recompute_method, recompute_num_layers) of full recompute
    shared_ffn: int = 0  # shared experts' FFN width (0: none)
    load_balancing: str = "none"  # moe_router_load_balancing_type ("aux_loss": with aux_loss_coeff)
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float | None = None
    per_token_loss: bool = False  # calculate_per_token_loss
    packed: bool = False  # core attention that runs packed (THD) microbatches (thd_attention.py)
    config: tuple = ()  # more TransformerConfig fields, as (name, value) pairs, set when the config is built
    te: bool = False  # Megatron-Core's Transformer Engine spec (GPU)


# Multi-latent attention: small latent ranks and head sizes; yarn's scaling as DeepSeek-V3 configures it.
MLA_FIELDS = dict(
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_head_dim=8,
    qk_pos_emb_head_dim=8,
    v_head_dim=8,
    rotary_scaling_factor=4,
    original_max_position_embeddings=4,
)


def local_mla_core_attention():
    """Megatron-Core 0.19's local attention, taking the head sizes MLA passes it (its own ``__init__`` does not, so
    its local MLA spec does not build): the output has ``v_channels`` per head."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LocalMLACoreAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return LocalMLACoreAttention


def gpt_block_spec(config, vp_stage: int | None = None, te: bool = False):
    """Megatron-Core's local decoder block spec for ``config`` (with MLA's core attention made to build), or with
    ``te`` its Transformer Engine spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=te, vp_stage=vp_stage)
    if te:
        return spec
    if config.multi_latent_attention:
        for layer_spec in spec.layer_specs:
            layer_spec.submodules.self_attention.submodules.core_attention = local_mla_core_attention()
    return spec


def _full_recompute_fields(case: McoreCase) -> dict:
    if case.full_recompute is None:
        return {}
    method, layers = case.full_recompute
    return {"recompute_granularity": "full", "recompute_method": method, "recompute_num_layers": layers}


def gpt_config(case: McoreCase, *, overlap_flag: bool = False, **fields):
    """The ``TransformerConfig`` (``MLATransformerConfig`` with ``case.mla``) of ``case``'s ``GPTModel``; ``fields``
    add to it (pipeline sizes)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    fields = (
        dict(
            **(MLA_FIELDS if case.mla else {}),
            num_layers=len(case.layer_freq),
            hidden_size=32,
            num_attention_heads=2,
            ffn_hidden_size=48,
            num_moe_experts=2 * case.world,
            moe_ffn_hidden_size=16,
            moe_router_topk=case.topk,
            moe_router_pre_softmax=case.topk == 1,
            moe_router_load_balancing_type=case.load_balancing,
            moe_aux_loss_coeff=case.aux_loss_coeff,
            moe_z_loss_coeff=case.z_loss_coeff,
            calculate_per_token_loss=case.per_token_loss,
            moe_layer_freq=list(case.layer_freq),
            expert_model_parallel_size=case.world,
            moe_token_dispatcher_type=case.dispatcher,
            moe_flex_dispatcher_backend=case.flex_backend,
            use_cpu_initialization=True,
            add_bias_linear=False,
            attention_dropout=0.0,
            hidden_dropout=0.0,
            bf16=case.bf16,
            params_dtype=torch.bfloat16 if case.bf16 else torch.float32,
            delay_wgrad_compute=False,
            overlap_moe_expert_parallel_comm=overlap_flag,  # Megatron-Core accepts it with bf16 only
            moe_router_score_function="sigmoid" if case.expert_bias else "softmax",
            moe_router_enable_expert_bias=case.expert_bias,
            moe_router_bias_update_rate=0.05,
            mtp_num_layers=1 if case.mtp else None,
            moe_shared_expert_intermediate_size=case.shared_ffn or None,
            **(
                _full_recompute_fields(case)
                if case.full_recompute
                else {
                    "recompute_granularity": "selective" if case.recompute else None,
                    "recompute_modules": list(case.recompute) or None,
                }
            ),
        )
        | dict(case.config)
        | fields
    )  # the case's own fields (GPT-OSS's biases, ...) override the defaults
    return with_yarn((MLATransformerConfig if case.mla else TransformerConfig)(**fields), case)


# YaRN's scaling as Bridge's GPT-OSS provider sets it, with a short original context for these short sequences.
YARN_FIELDS = dict(
    yarn_rotary_scaling_factor=32.0,
    yarn_original_max_position_embeddings=4,
    yarn_beta_fast=32.0,
    yarn_beta_slow=1.0,
    yarn_correction_range_round_to_int=False,
    yarn_mscale=None,
    yarn_mscale_all_dim=None,
)


def with_yarn(config, case: McoreCase):
    """``config`` with YaRN's fields where the case has YaRN positions (Bridge's providers carry them; Megatron-Core's
    ``TransformerConfig`` does not declare them, its ``GPTModel`` reads them by name)."""
    for name, value in YARN_FIELDS.items() if case.yarn else ():
        setattr(config, name, value)
    return config


def position_embedding_type(case: McoreCase) -> str:
    return "yarn" if case.yarn else "rope" if case.rope else "learned_absolute"


def gpt_model(case: McoreCase, config, vp_stage: int | None = None, **chunk):
    """``case``'s ``GPTModel`` (or, with ``vp_stage`` and ``pre_process``/``post_process`` in ``chunk``, one
    pipeline chunk of it), with one MTP layer like its last decoder layer where ``case.mtp``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    spec = gpt_block_spec(config, vp_stage=vp_stage, te=case.te)
    if case.packed:
        from .thd_attention import with_packed_attention

        with_packed_attention(spec)
    mtp = None
    if case.mtp:
        mtp = get_gpt_mtp_block_spec(config, spec.layer_specs[-1] if spec.layer_specs else None, False, vp_stage)
    return GPTModel(
        config,
        transformer_layer_spec=spec,
        mtp_block_spec=mtp,
        vocab_size=64,
        max_sequence_length=8,
        position_embedding_type=position_embedding_type(case),
        share_embeddings_and_output_weights=case.tied,
        vp_stage=vp_stage,
        **chunk,
    )


def build_gpt(case: McoreCase, *, overlap_flag: bool = False):
    config = gpt_config(case, overlap_flag=overlap_flag)
    torch.manual_seed(1234)
    model = gpt_model(case, config)
    model = model.to(case.device)
    return model.bfloat16() if case.bf16 else model  # what Megatron's Float16Module does to the module


def build_model(case: McoreCase, *, overlap_flag: bool = False):
    """A ``GPTModel``, or a ``HybridModel`` for a ``HybridCase``."""
    build = build_hybrid if isinstance(case, HybridCase) else build_gpt
    return build(case, overlap_flag=overlap_flag)


def expected_mlps(case: McoreCase) -> list[str]:
    """Each decoder layer's MLP class: from ``layer_freq``, or from a hybrid pattern (attention layers have none)."""
    if not isinstance(case, HybridCase):
        return ["MoELayer" if moe else "MLP" for moe in case.layer_freq]
    kinds = {"E": "MoELayer", "-": "MLP", "*": "IdentityOp", "+": "IdentityOp", "M": "NoneType"}  # Mamba: no MLP
    return [kinds[c] for c in case.pattern.split("/")[0].replace("|", "")]  # the MTP layers are not the decoder's


@dataclass(frozen=True)
class HybridCase(McoreCase):
    """A hybrid stack's pattern (``|`` between pipeline segments) and the run's shape (``McoreCase``'s fields;
    ``layer_freq`` is unused)."""

    pattern: str = "*E*E"


def build_hybrid(
    case: HybridCase,
    *,
    overlap_flag: bool = False,
    pp: int = 1,
    vpp: int | None = None,
    vp_stage: int | None = None,
    pre_process: bool = True,
    post_process: bool = True,
):
    import megatron.core.models.hybrid.hybrid_block as hybrid_block
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    experts = 2 * case.world
    if case.te:  # Megatron-Core's own spec: Transformer Engine layers, Mamba (and GDN) with their CUDA kernels
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec as stack_spec

        mamba = dict(mamba_head_dim=16, mamba_num_groups=1, mamba_state_dim=16)
    else:
        dense, moe = get_gpt_layer_local_spec().submodules, get_gpt_layer_local_spec(num_experts=experts).submodules
        if case.packed:
            from .thd_attention import PackedCausalAttention

            dense.self_attention.submodules.core_attention = PackedCausalAttention
        hybrid_block.TENorm = dense.input_layernorm
        layers = dict(
            attention_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
                input_layernorm=dense.input_layernorm, self_attention=dense.self_attention,
                self_attn_bda=dense.self_attn_bda)),
            mlp_layer=ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=dense.pre_mlp_layernorm, mlp=dense.mlp, mlp_bda=dense.mlp_bda)),
            moe_layer=ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=moe.pre_mlp_layernorm, mlp=moe.mlp, mlp_bda=moe.mlp_bda)),
        )  # fmt: skip
        if "+" in case.pattern:
            mla = get_gpt_layer_local_spec(multi_latent_attention=True).submodules
            mla.self_attention.submodules.core_attention = local_mla_core_attention()
            layers["mla_layer"] = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
                input_layernorm=mla.input_layernorm, self_attention=mla.self_attention,
                self_attn_bda=mla.self_attn_bda))  # fmt: skip
        stack_spec = ModuleSpec(
            module=hybrid_block.HybridStack,
            submodules=hybrid_block.HybridStackSubmodules(**layers, mtp_block_spec=_local_hybrid_mtp_spec()),
        )
        mamba = {}
    pattern = case.pattern if pp > 1 else case.pattern.replace("|", "")
    main, *depths = pattern.split("/")
    fields = dict(
        **(MLA_FIELDS if "+" in case.pattern else {}),
        num_layers=sum(c != "|" for c in main), mtp_num_layers=len(depths) or None,
        hidden_size=32, num_attention_heads=2, ffn_hidden_size=48,
        num_moe_experts=experts, moe_ffn_hidden_size=16, moe_router_topk=case.topk,
        moe_router_pre_softmax=case.topk == 1, moe_router_load_balancing_type="none",
        expert_model_parallel_size=case.world, moe_token_dispatcher_type=case.dispatcher, use_cpu_initialization=True,
        add_bias_linear=False, attention_dropout=0.0, hidden_dropout=0.0,
        overlap_moe_expert_parallel_comm=overlap_flag, pipeline_model_parallel_size=pp, bf16=case.bf16,
        params_dtype=torch.bfloat16 if case.bf16 else torch.float32,
        virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=torch.float32 if pp > 1 else None, **mamba,
        **_full_recompute_fields(case),
    ) | dict(case.config)  # fmt: skip
    config = with_yarn((MLATransformerConfig if "+" in case.pattern else TransformerConfig)(**fields), case)
    torch.manual_seed(1234)
    model = HybridModel(
        config,
        hybrid_stack_spec=stack_spec,
        vocab_size=64,
        max_sequence_length=8,
        hybrid_layer_pattern=pattern,
        position_embedding_type=position_embedding_type(case),
        share_embeddings_and_output_weights=case.tied,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
    )
    model = model.to(case.device)
    return model.bfloat16() if case.bf16 else model  # what Megatron's Float16Module does to the module


def _local_hybrid_mtp_spec():
    """Megatron-Core's hybrid MTP block spec (``hybrid_layer_specs``) with local modules in place of Transformer
    Engine's: norms and the projection; the stack builds the layers inside from the pattern after ``/``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    norm = get_gpt_layer_local_spec().submodules.input_layernorm
    layer = MultiTokenPredictionLayerSubmodules(
        enorm=norm, hnorm=norm, eh_proj=ColumnParallelLinear, mtp_model_layer=None, layer_norm=norm
    )
    return ModuleSpec(
        module=MultiTokenPredictionBlock,
        submodules=MultiTokenPredictionBlockSubmodules(
            layer_specs=[ModuleSpec(module=MultiTokenPredictionLayer, submodules=layer)]
        ),
    )
