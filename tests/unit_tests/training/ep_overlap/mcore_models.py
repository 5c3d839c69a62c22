"""Test-only: the Megatron-Core models the adapter tests build, from local (non-Transformer-Engine) specs, for CPU.

:class:`McoreCase` and :func:`build_gpt`: a ``GPTModel``. :class:`HybridCase` and :func:`build_hybrid`: a
``HybridModel``. Megatron-Core ships only a Transformer Engine spec for ``HybridModel`` (``hybrid_stack_spec``);
:func:`local_hybrid_stack_spec` is its local twin: attention (``*``), MLA (``+``), MLP (``-``) and MoE (``E``) from
``get_gpt_layer_local_spec()``, Mamba (``M``: ``MambaLayer`` with its own norm and ``MambaMixer`` with local
in/out projections, where Transformer Engine fuses the norm into ``in_proj``) and GDN (``G``: a ``TransformerLayer``
whose self-attention is ``GatedDeltaNet``, local norm before it), the stack's final norm (Transformer Engine's
``TENorm``, hard-wired in ``HybridStack``) made the local norm, and for a pattern's MTP part (after ``/``) the MTP
block with local norms and projection. Megatron-Core 0.19's local MLA spec (``+``, and ``McoreCase.mla``) does not
build as shipped (its ``DotProductAttention`` takes no ``k_channels``): here its core attention takes MLA's head
sizes.

A ``GPTModel`` with gated delta net attention (Qwen3-Next, Qwen3.5: ``experimental_attention_variant=
'gated_delta_net'``, GDN layers and attention layers by ``linear_attention_freq``): ``McoreCase.gdn_freq``, built
from :func:`local_gdn_decoder_block_spec`, the local twin of the Transformer Engine block spec Megatron-Bridge
0.6.2's Qwen3-Next provider sets (``get_transformer_block_with_experimental_attention_variant_spec``); its MTP block:
:func:`local_gdn_mtp_block_spec`. Norms are :class:`LocalNorm` (Megatron-Core's local one refuses
``layernorm_zero_centered_gamma``, which Qwen3-Next sets).

Mamba and GDN mixers call CUDA/Triton kernels: build after ``install_cpu_stubs`` and, where the model has them,
``ssm_kernels.install_mamba_kernels()`` / ``install_gdn_kernels()`` (on CPU; :func:`install_kernels_for` does both
as a case needs them).
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
    gdn_freq: int | tuple | None = None  # a GPTModel with gated delta net: linear_attention_freq (a tuple: per layer)


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


def _model_layer_specs(config, te: bool) -> list:
    """Every decoder layer's spec of the model, whatever the stage (as Bridge derives an MTP layer's kind on a stage
    without decoder layers)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs

    specs = get_gpt_decoder_layer_specs(config, use_transformer_engine=te, normalization=config.normalization)
    if config.multi_latent_attention and not te:
        for layer_spec in specs:
            layer_spec.submodules.self_attention.submodules.core_attention = local_mla_core_attention()
    return specs


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


class LocalNorm:
    """Megatron-Core's local norm (torch's ``LayerNorm`` or ``RMSNorm``), and with ``layernorm_zero_centered_gamma``
    (which it refuses) a :class:`ZeroCenteredNorm`, as Transformer Engine's norm reads that field."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        if config.layernorm_zero_centered_gamma:
            return ZeroCenteredNorm(hidden_size, eps, rms=config.normalization == "RMSNorm")
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        return WrappedTorchNorm(config, hidden_size, eps)


class ZeroCenteredNorm(torch.nn.Module):
    """A norm whose weight starts at zero and scales by ``1 + weight`` (RMSNorm, or LayerNorm with a bias)."""

    def __init__(self, hidden_size: int, eps: float, rms: bool):
        super().__init__()
        self.eps, self.rms = eps, rms
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
        self.bias = None if rms else torch.nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x_SBH: torch.Tensor) -> torch.Tensor:
        shape = (x_SBH.shape[-1],)
        if self.rms:
            return torch.nn.functional.rms_norm(x_SBH, shape, 1 + self.weight, self.eps)
        return torch.nn.functional.layer_norm(x_SBH, shape, 1 + self.weight, self.bias, self.eps)


def _local_norms(submodules) -> None:
    """Each Megatron-Core local norm in ``submodules`` (a layer's, its attention's) becomes :class:`LocalNorm`."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    for holder in (submodules, getattr(getattr(submodules, "self_attention", None), "submodules", None)):
        for name in ("input_layernorm", "pre_mlp_layernorm", "q_layernorm", "k_layernorm", "kv_layernorm"):
            if holder is not None and getattr(holder, name, None) is WrappedTorchNorm:
                setattr(holder, name, LocalNorm)


def local_gdn_spec():
    """``GatedDeltaNet`` with local modules: input projection and output projection Megatron-Core's local linears
    (Transformer Engine's spec fuses the layer's input norm into ``in_proj``; here the layer's ``input_layernorm``
    runs before it), the gated output norm :class:`LocalNorm`."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    submodules = GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=LocalNorm, out_proj=RowParallelLinear)
    return ModuleSpec(module=GatedDeltaNet, submodules=submodules)


def gdn_layer_specs(config) -> list:
    """Every decoder layer's local spec for a ``gated_delta_net`` config (see :func:`local_gdn_decoder_block_spec`)."""
    import copy

    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_linear_attention_pattern,
        get_moe_layer_pattern,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    def local(num_experts=None):
        layer = get_gpt_layer_local_spec(
            num_experts=num_experts, qk_layernorm=config.qk_layernorm, normalization=config.normalization,
            qk_l2_norm=config.qk_l2_norm,
        ).submodules  # fmt: skip
        _local_norms(layer)
        return layer

    attention, dense = local(), local()
    moe = local(config.num_moe_experts) if config.num_moe_experts else None
    moe_layers = get_moe_layer_pattern(config) if moe is not None else [0] * config.num_layers
    specs = []
    for gdn, is_moe in zip(get_linear_attention_pattern(config), moe_layers):
        submodules = TransformerLayerSubmodules(
            input_layernorm=LocalNorm,
            self_attention=local_gdn_spec() if gdn else copy.deepcopy(attention.self_attention),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=LocalNorm,
            mlp=(moe if is_moe else dense).mlp,
            mlp_bda=get_bias_dropout_add,
        )
        specs.append(ModuleSpec(module=TransformerLayer, submodules=submodules))
    return specs


def local_gdn_decoder_block_spec(config, vp_stage: int | None = None, pp_rank: int | None = None):
    """The local twin of Megatron-Core's ``get_transformer_block_with_experimental_attention_variant_spec`` (what
    Bridge 0.6.2's Qwen3-Next provider sets as ``transformer_layer_spec``; Transformer Engine only) for a
    ``gated_delta_net`` config: per layer, GDN (:func:`local_gdn_spec`) or Megatron-Core's local self-attention
    (query/key norms, gated output as the config says) by ``linear_attention_freq``, an MoE or dense local MLP by
    ``moe_layer_freq``, :class:`LocalNorm` before each; the layers of this pipeline stage (``vp_stage``,
    ``pp_rank``, or the config's layout), as Megatron-Core's function selects them."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    specs = gdn_layer_specs(config)
    layout = config.pipeline_model_parallel_layout
    if layout is not None and hasattr(layout, "get_layer_id_list"):
        local_ids = layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank)
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        local_ids = range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank))
    return TransformerBlockSubmodules(layer_specs=[specs[i] for i in local_ids], layer_norm=LocalNorm)


def local_gdn_mtp_block_spec(config, vp_stage: int | None = None, layer_spec=None):
    """Bridge 0.6.2's ``gpt_provider.mtp_block_spec`` for a ``gated_delta_net`` config, with local modules: the MTP
    layer like the last decoder layer (``layer_spec``; by default this stage's last, or the model's last where the
    stage has none, as Bridge derives it), its norms :class:`LocalNorm`; None without an MTP layer on this stage."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    if not config.mtp_num_layers:
        return None
    if layer_spec is None:
        stage = local_gdn_decoder_block_spec(config, vp_stage).layer_specs
        layer_spec = stage[-1] if stage else gdn_layer_specs(config)[-1]
    block = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False, vp_stage=vp_stage)
    for layer in block.layer_specs if block is not None else ():
        for name in ("enorm", "hnorm", "layer_norm"):
            setattr(layer.submodules, name, LocalNorm)
    return block


def _recompute_fields(case: McoreCase) -> dict:
    """Full recompute's fields, else selective recompute's (``case.recompute``), else none."""
    if case.full_recompute is None:
        selective = {"recompute_granularity": "selective", "recompute_modules": list(case.recompute)}
        return selective if case.recompute else {}
    method, layers = case.full_recompute
    return {"recompute_granularity": "full", "recompute_method": method, "recompute_num_layers": layers}


def gpt_config(case: McoreCase, *, overlap_flag: bool = False, **fields):
    """The ``TransformerConfig`` (``MLATransformerConfig`` with ``case.mla``) of ``case``'s ``GPTModel``; ``fields``
    add to it (pipeline sizes)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    fields = (
        dict(
            **(MLA_FIELDS if case.mla else {}),
            **(gdn_fields(case.gdn_freq) if case.gdn_freq else {}),
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
            **(_recompute_fields(case) or {"recompute_granularity": None, "recompute_modules": None}),
        )
        | dict(case.config)
        | fields
    )  # the case's own fields (GPT-OSS's biases, ...) override the defaults
    return with_yarn((MLATransformerConfig if case.mla else TransformerConfig)(**fields), case)


# Gated delta net: small heads (four value heads on two query/key heads), Qwen3-Next's conv width, SiLU (the mixer's
# convolution takes only SiLU; it reads the config's activation).
GDN_FIELDS = dict(
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    activation_func=torch.nn.functional.silu,
)
# What Bridge 0.6.2's Qwen3-Next provider sets besides the attention variant (Qwen3NextBridge.provider_bridge), as
# (name, value) pairs for McoreCase.config: RMSNorm with zero-centered weights, query/key norms, gated attention
# output, gated SiLU MLPs, a gated shared expert.
QWEN3_NEXT_FIELDS = (
    ("normalization", "RMSNorm"),
    ("layernorm_zero_centered_gamma", True),
    ("qk_layernorm", True),
    ("attention_output_gate", True),
    ("gated_linear_unit", True),
    ("moe_shared_expert_gate", True),
    ("moe_router_dtype", "fp32"),
)


def gdn_fields(linear_attention_freq) -> dict:
    """A config's gated delta net fields: GDN layers where ``linear_attention_freq`` puts them, attention between."""
    freq = list(linear_attention_freq) if isinstance(linear_attention_freq, tuple) else linear_attention_freq
    return dict(GDN_FIELDS, experimental_attention_variant="gated_delta_net", linear_attention_freq=freq)


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

    gdn = config.experimental_attention_variant == "gated_delta_net" and not case.te
    spec = local_gdn_decoder_block_spec(config, vp_stage) if gdn else gpt_block_spec(config, vp_stage, case.te)
    if case.packed:
        from .thd_attention import with_packed_attention

        with_packed_attention(spec)
    mtp = None
    if case.mtp and gdn:
        mtp = local_gdn_mtp_block_spec(config, vp_stage, spec.layer_specs[-1] if spec.layer_specs else None)
    elif case.mtp:
        layers = spec.layer_specs or _model_layer_specs(config, case.te)  # a stage of MTP alone: the last layer's kind
        mtp = get_gpt_mtp_block_spec(config, layers[-1], False, vp_stage)
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
    """Each decoder layer's MLP class: from ``layer_freq``, or from a hybrid pattern (attention and GDN layers have an
    identity, Mamba layers none)."""
    if not isinstance(case, HybridCase):
        return ["MoELayer" if moe else "MLP" for moe in case.layer_freq]
    kinds = {"E": "MoELayer", "-": "MLP", "*": "IdentityOp", "+": "IdentityOp", "G": "IdentityOp", "M": "NoneType"}
    return [kinds[c] for c in case.pattern.split("/")[0].replace("|", "")]  # the MTP layers are not the decoder's


@dataclass(frozen=True)
class HybridCase(McoreCase):
    """A hybrid stack's pattern (``|`` between pipeline segments) and the run's shape (``McoreCase``'s fields;
    ``layer_freq`` is unused). ``mamba_chunk``: the Mamba scan's chunk size (Bridge's ``mamba_chunk_size``; below the
    sequence length, so the scan carries its state across chunks)."""

    pattern: str = "*E*E"
    mamba_chunk: int = 4


# Mamba: 8 heads of 8 channels (expand 2 of hidden 32), in 2 groups, state 8.
MAMBA_FIELDS = dict(mamba_head_dim=8, mamba_num_groups=2, mamba_state_dim=8)


def install_kernels_for(case: McoreCase) -> None:
    """The CPU stand-ins of the kernels ``case``'s model calls (``ssm_kernels.py``), before it is built."""
    from .ssm_kernels import install_gdn_kernels, install_mamba_kernels

    pattern = getattr(case, "pattern", "")
    if "M" in pattern:
        install_mamba_kernels()
    if "G" in pattern or case.gdn_freq:
        install_gdn_kernels()


def local_hybrid_stack_spec(config=None, *, packed: bool = False):
    """``HybridStack``'s spec with Megatron-Core's local modules (the module docstring), for every layer symbol, and
    the MTP block's norms and projection local. Also makes ``HybridStack``'s final norm (Transformer Engine's
    ``TENorm``, which it names directly) the local norm, in this process. ``config`` (optional: Bridge's
    ``HybridModelProvider.hybrid_stack_spec`` may be this function) adds MLA layers where it has
    ``multi_latent_attention`` and zero-centered norms where it says so; ``packed``: attention layers that run packed
    (THD) microbatches (``thd_attention.py``)."""
    import megatron.core.models.hybrid.hybrid_block as hybrid_block
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    experts = getattr(config, "num_moe_experts", None) or 8  # the spec does not depend on the count
    normalization = getattr(config, "normalization", None)
    dense = get_gpt_layer_local_spec(normalization=normalization).submodules
    moe = get_gpt_layer_local_spec(num_experts=experts, normalization=normalization).submodules
    for layer in (dense, moe):
        _local_norms(layer)
    if packed:
        from .thd_attention import PackedCausalAttention

        dense.self_attention.submodules.core_attention = PackedCausalAttention
    hybrid_block.TENorm = LocalNorm
    mixer = ModuleSpec(
        module=MambaMixer,
        submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
    )
    layers = dict(
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=dense.input_layernorm, self_attention=dense.self_attention,
            self_attn_bda=dense.self_attn_bda)),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=dense.pre_mlp_layernorm, mlp=dense.mlp, mlp_bda=dense.mlp_bda)),
        moe_layer=ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=moe.pre_mlp_layernorm, mlp=moe.mlp, mlp_bda=moe.mlp_bda)),
        mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
            norm=LocalNorm, mixer=mixer, mamba_bda=get_bias_dropout_add)),
        gdn_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=LocalNorm, self_attention=local_gdn_spec(), self_attn_bda=get_bias_dropout_add)),
    )  # fmt: skip
    if getattr(config, "multi_latent_attention", False):
        mla = get_gpt_layer_local_spec(multi_latent_attention=True, normalization=normalization).submodules
        _local_norms(mla)
        mla.self_attention.submodules.core_attention = local_mla_core_attention()
        layers["mla_layer"] = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=mla.input_layernorm, self_attention=mla.self_attention,
            self_attn_bda=mla.self_attn_bda))  # fmt: skip
    return ModuleSpec(
        module=hybrid_block.HybridStack,
        submodules=hybrid_block.HybridStackSubmodules(**layers, mtp_block_spec=_local_hybrid_mtp_spec()),
    )


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
    import torch
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    experts = 2 * case.world
    kinds = set(case.pattern)
    # Transformer Engine's spec (GPU): the sizes its kernels were checked with; local: MAMBA_FIELDS
    mamba = dict(mamba_head_dim=16, mamba_num_groups=1, mamba_state_dim=16) if case.te else {}
    mamba = MAMBA_FIELDS if "M" in kinds and not case.te else mamba
    gdn = GDN_FIELDS if "G" in kinds else {}
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
        virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=torch.float32 if pp > 1 else None, **mamba, **gdn,
        **_recompute_fields(case),
    ) | dict(case.config)  # fmt: skip
    config = with_yarn((MLATransformerConfig if "+" in case.pattern else TransformerConfig)(**fields), case)
    if case.te:  # Megatron-Core's own spec: Transformer Engine layers, Mamba (and GDN) with their CUDA kernels
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec as stack_spec
    else:
        stack_spec = local_hybrid_stack_spec(config, packed=case.packed)
        if "M" in kinds:  # as Bridge's HybridModelProvider sets its mamba_chunk_size
            stack_spec.submodules.mamba_layer.submodules.mixer.params = {"chunk_size": case.mamba_chunk}
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
