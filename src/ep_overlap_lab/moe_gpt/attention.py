"""The reference MoE GPT's dense parts: a delayable bias-free linear, the MLP activation, causal self-attention
(multi-head or grouped-query) and the norms, each as Megatron-Core defines it (see ``model.py`` for the model).

Shape suffixes as in ``model.py``; Q is the fused query/key/value width, d one head's.
"""

import torch
import torch.nn.functional as F

from ep_overlap_lab.moe_gpt import recompute
from ep_overlap_lab.moe_gpt.config import MoEGPTConfig
from ep_overlap_lab.moe_gpt.grouped_linear import GroupedLinear


class Linear(GroupedLinear):
    """A bias-free linear with delayable weight gradient (a grouped linear with one group)."""

    def __init__(self, in_features: int, out_features: int, *, name: str):
        super().__init__(1, in_features, out_features, name=name)

    def forward(self, x_TK: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x_TK, (x_TK.shape[0],))


def activation(x: torch.Tensor, gated: bool) -> torch.Tensor:
    """SwiGLU (SiLU of the first half times the second) when ``gated``, else GELU."""
    if gated:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(x)


class Attention(torch.nn.Module):
    """Causal self-attention; q/k/v and output projections are delayable linears. ``num_query_groups`` (G) key/value
    heads, each shared by H / G query heads (grouped-query attention; G = H is multi-head), of ``kv_channels`` (d)
    each; softmax scale 1 / sqrt(d), as Megatron-Core defines them."""

    def __init__(self, config: MoEGPTConfig, name: str):
        super().__init__()
        D, H = config.hidden_size, config.num_attention_heads
        G = config.num_query_groups or H
        if (config.kv_channels is None and D % H) or H % G:
            raise ValueError(
                f"{name}: hidden_size={D} and num_query_groups={G} must divide num_attention_heads={H} "
                "(without kv_channels, hidden_size must be divisible by the heads)"
            )
        self.heads, self.groups, self.seq_length = H, G, config.seq_length
        self.head_dim = config.kv_channels or D // H
        d = self.head_dim
        self.qkv = Linear(D, (H + 2 * G) * d, name=f"{name}.qkv")  # [q (H x d) | k (G x d) | v (G x d)] per token
        self.proj = Linear(H * d, D, name=f"{name}.proj")
        self.recompute_core = "core_attn" in recompute.recompute_modules(config)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.attend(self.qkv(x_TD))

    def attend(self, qkv_TQ: torch.Tensor) -> torch.Tensor:
        """Everything after the q/k/v projection: the causal attention and the output projection."""
        T, S, H, G, d = qkv_TQ.shape[0], self.seq_length, self.heads, self.groups, self.head_dim
        if G == H:
            q_BHSd, k_BHSd, v_BHSd = qkv_TQ.view(T // S, S, 3, H, d).permute(2, 0, 3, 1, 4)
        else:
            q_TQ, k_TQ, v_TQ = qkv_TQ.split([H * d, G * d, G * d], dim=-1)
            q_BHSd = q_TQ.view(T // S, S, H, d).transpose(1, 2)
            # each key/value head serves H / G consecutive query heads, as Megatron-Core repeats them
            k_BHSd = k_TQ.view(T // S, S, G, d).transpose(1, 2).repeat_interleave(H // G, dim=1)
            v_BHSd = v_TQ.view(T // S, S, G, d).transpose(1, 2).repeat_interleave(H // G, dim=1)
        o_BHSd = recompute.run(self.recompute_core, _causal_attention, q_BHSd, k_BHSd, v_BHSd)
        return self.proj(o_BHSd.transpose(1, 2).reshape(T, H * d))


def norm(config: MoEGPTConfig, D: int) -> torch.nn.Module:
    """``normalization``: LayerNorm, or RMSNorm (x / sqrt(mean(x^2) + eps) * weight), with ``layernorm_epsilon``."""
    if config.normalization == "RMSNorm":
        return torch.nn.RMSNorm(D, eps=config.layernorm_epsilon)
    return torch.nn.LayerNorm(D, eps=config.layernorm_epsilon)


def _causal_attention(q_BHSd: torch.Tensor, k_BHSd: torch.Tensor, v_BHSd: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q_BHSd, k_BHSd, v_BHSd, is_causal=True)
