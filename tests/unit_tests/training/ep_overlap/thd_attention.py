"""Test-only: a core attention for packed (THD) microbatches on CPU, for Megatron-Core's local layer specs.

Megatron-Core's local ``DotProductAttention`` refuses ``packed_seq_params`` (only Transformer Engine's attention runs
THD). :class:`PackedCausalAttention` runs each document of the packed row on its own: for every ``cu_seqlens_q``
segment, the local attention (causal within the segment), the outputs concatenated back in order. Query, key and
value arrive as Megatron-Core's attention hands them over for THD, ``[tokens, heads, head_dim]``; the output is
``[tokens, heads * head_dim]``. Without ``packed_seq_params`` it is the local attention unchanged. Placed in a spec
with :func:`with_packed_attention`, as the flex stand-in is.
"""

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention


class PackedCausalAttention(DotProductAttention):
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):  # fmt: skip
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        assert packed_seq_params.qkv_format == "thd", packed_seq_params.qkv_format
        cu_seqlens = packed_seq_params.cu_seqlens_q.tolist()
        documents = []
        for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            q, k, v = (t[start:end].unsqueeze(1) for t in (query, key, value))  # [s, b=1, heads, head_dim]
            causal = torch.ones(end - start, end - start, dtype=torch.bool, device=query.device).triu(1)[None, None]
            documents.append(super().forward(q, k, v, causal, attn_mask_type, attention_bias))
        return torch.cat(documents, dim=0).squeeze(1)  # [tokens, heads * head_dim]


def with_packed_attention(spec):
    """``spec`` (a block spec or a layer spec of Megatron-Core's local specs) with :class:`PackedCausalAttention`
    as every self-attention's core attention."""
    layers = getattr(spec, "layer_specs", None) or [spec]
    for layer in layers:
        attention = getattr(layer.submodules, "self_attention", None)
        if attention is not None and hasattr(attention.submodules, "core_attention"):
            attention.submodules.core_attention = PackedCausalAttention
    return spec
