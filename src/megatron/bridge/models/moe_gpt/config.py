"""Config of the reference MoE GPT: a Megatron-Core ``TransformerConfig`` plus what a GPT provider adds."""

import math
from dataclasses import dataclass

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.bridge.models.moe_gpt.recompute import RECOMPUTABLE


@dataclass
class MoEGPTConfig(TransformerConfig):
    """Megatron field names drive every shape; the same object passes through ``CommOverlapConfig.setup``.

    Read by the reference model: ``num_layers``, ``hidden_size``, ``num_attention_heads``, ``ffn_hidden_size``
    (dense MLP), ``moe_ffn_hidden_size``, ``num_moe_experts``, ``moe_router_topk``, ``moe_layer_freq`` (int k:
    every k-th layer is MoE; list: 1 = MoE, 0 = dense per layer), ``expert_model_parallel_size``,
    ``gated_linear_unit`` (SwiGLU, else GELU), ``bf16``, ``init_method_std``, ``moe_router_score_function``
    (softmax or sigmoid), ``moe_router_pre_softmax`` (softmax only), ``moe_router_enable_expert_bias`` and
    ``moe_router_bias_update_rate`` (aux-loss-free load balancing, sigmoid only), plus ``vocab_size`` and
    ``seq_length`` below.
    """

    vocab_size: int = 1024
    seq_length: int = 128
    # The reference model's token dispatcher is an all-to-all over the EP group.
    moe_token_dispatcher_type: str = "alltoall"
    # The reference model has no dropout; zero also keeps a Megatron-Core model built from this config deterministic.
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    # Which EP-overlap schedule runs this model; the rules differ (see training/moe_overlap_rules.py).
    ep_overlap_schedule: str = "bridge"
    # For a Megatron-Core HybridModel built from this config (the harness's --model_impl mcore); the reference
    # model refuses it (model_feature_problems).
    hybrid_layer_pattern: str | None = None

    def activation_dtype(self) -> torch.dtype:
        """Dtype of parameters and activations: bf16, fp16, else fp32."""
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether layer ``layer_number`` (0-based) is an MoE layer, following ``moe_layer_freq``."""
        if not self.num_moe_experts:
            return False
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            return layer_number % freq == 0
        if len(freq) != self.num_layers:
            raise ValueError(f"moe_layer_freq has {len(freq)} entries but num_layers={self.num_layers}")
        return bool(freq[layer_number])


# Router settings the reference model can run: (field, is the value wrong, why, fix). Megatron-Core's own rule for
# expert bias (sigmoid scores only) is repeated so an override made after construction is refused too.
_ROUTER_RULES = (
    (
        "moe_router_score_function",
        lambda c: c.moe_router_score_function not in ("softmax", "sigmoid"),
        "the reference MoE GPT scores experts with softmax or sigmoid",
        "set it to 'softmax' or 'sigmoid'",
    ),
    (
        "moe_router_enable_expert_bias",
        lambda c: c.moe_router_enable_expert_bias and c.moe_router_score_function != "sigmoid",
        "expert bias needs sigmoid scores",
        "set moe_router_score_function='sigmoid', or moe_router_enable_expert_bias=False",
    ),
    (
        "moe_router_bias_update_rate",
        lambda c: (
            c.moe_router_enable_expert_bias
            and not (
                isinstance(c.moe_router_bias_update_rate, int | float)
                and math.isfinite(c.moe_router_bias_update_rate)
                and c.moe_router_bias_update_rate > 0
            )
        ),
        "the expert-bias update rate must be a positive number",
        "set it to a positive number, e.g. 1e-3",
    ),
)


# Model features the reference model does not have: (field, is it asked for, why, fix). Refused rather than ignored.
_FEATURE_RULES = (
    (
        "mtp_num_layers",
        lambda c: bool(c.mtp_num_layers),
        "the reference MoE GPT has no multi-token prediction layers",
        "drop it, or run a Megatron-Core model (the harness's --model_impl mcore)",
    ),
    (
        "hybrid_layer_pattern",
        lambda c: c.hybrid_layer_pattern is not None,
        "the reference MoE GPT is not a hybrid model",
        "drop it, or run a Megatron-Core HybridModel (the harness's --model_impl mcore)",
    ),
    (
        "recompute_granularity",
        lambda c: c.recompute_granularity not in (None, "selective"),
        "the reference MoE GPT recomputes selected modules, not whole layers",
        "set recompute_granularity='selective' and choose recompute_modules, or None",
    ),
    (
        "recompute_method",
        lambda c: c.recompute_method is not None,
        "layer recompute is not implemented by the reference MoE GPT",
        "set recompute_method=None (selective recompute: recompute_granularity='selective')",
    ),
    (
        "recompute_num_layers",
        lambda c: c.recompute_num_layers is not None,
        "layer recompute is not implemented by the reference MoE GPT",
        "set recompute_num_layers=None",
    ),
    (
        "recompute_modules",
        lambda c: c.recompute_granularity == "selective" and set(c.recompute_modules or ()) - set(RECOMPUTABLE),
        f"the reference MoE GPT recomputes {', '.join(RECOMPUTABLE)} only",
        "drop the others",
    ),
)


def model_feature_problems(config: MoEGPTConfig) -> list[str]:
    """One line per model feature ``config`` asks for that the reference model does not have (field, value, fix)."""
    return [
        f"{field}={getattr(config, field)!r}: {why}; {fix}"
        for field, wanted, why, fix in _FEATURE_RULES
        if wanted(config)
    ]


def router_problems(config: MoEGPTConfig) -> list[str]:
    """One line per router setting of ``config`` the reference model cannot run (field, value, why, fix)."""
    return [
        f"{field}={getattr(config, field)!r}: {why}; {fix}"
        for field, wrong, why, fix in _ROUTER_RULES
        if wrong(config)
    ]
