"""Test-only: a Megatron-Core ``HybridModel`` from local (non-Transformer-Engine) modules, for CPU ranks.

Megatron-Core ships only a Transformer Engine spec for ``HybridModel`` (``hybrid_stack_spec``); this one takes the
attention, MLP and MoE parts of ``get_gpt_layer_local_spec()``, and the stack's final norm (Transformer Engine's
``TENorm``, hard-wired in ``HybridStack``) becomes the local spec's norm. Call after ``install_cpu_stubs``.
"""


def build_hybrid(pattern: str, *, experts: int = 4, max_sequence_length: int = 8):
    import megatron.core.models.hybrid.hybrid_block as hybrid_block
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    dense, moe = get_gpt_layer_local_spec().submodules, get_gpt_layer_local_spec(num_experts=experts).submodules
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
    config = TransformerConfig(
        num_layers=len(pattern), hidden_size=32, num_attention_heads=2, ffn_hidden_size=48, num_moe_experts=experts,
        moe_ffn_hidden_size=16, moe_router_topk=2, moe_router_load_balancing_type="none",
        expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall", use_cpu_initialization=True,
        add_bias_linear=False, attention_dropout=0.0, hidden_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(1234)
    return HybridModel(
        config,
        hybrid_stack_spec=ModuleSpec(
            module=hybrid_block.HybridStack, submodules=hybrid_block.HybridStackSubmodules(**layers)
        ),
        vocab_size=64,
        max_sequence_length=max_sequence_length,
        hybrid_layer_pattern=pattern,
        position_embedding_type="learned_absolute",
    )
