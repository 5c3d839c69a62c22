"""Test-only: a core attention that takes context parallelism, as Transformer Engine's does on GPU (Megatron-Core's
local ``DotProductAttention`` refuses it), so Megatron-Core's local layers run with ``context_parallel_size > 1`` on
CPU.

Each context-parallel rank holds two of the sequence's ``2 * cp`` chunks, chunk ``r`` and chunk ``2 cp - 1 - r``
(Megatron-Core's ``get_batch_on_this_cp_rank``, which Bridge's ``get_batch`` calls). The rank gathers every rank's
keys and values (their gradients are summed back by a reduce-scatter), puts them in sequence order, and attends its
own queries causally by their positions in the whole sequence. Dropout is not taken (the tests run without it).
"""

import math

import torch
import torch.distributed as dist


class _GatherSequence(torch.autograd.Function):
    """All-gather along the first (sequence) dimension; the backward sums the gradients back to their ranks."""

    @staticmethod
    def forward(ctx, local_SBHD, group):
        ctx.group = group
        gathered = local_SBHD.new_empty((dist.get_world_size(group) * local_SBHD.shape[0], *local_SBHD.shape[1:]))
        dist.all_gather_into_tensor(gathered, local_SBHD.contiguous(), group=group)
        return gathered

    @staticmethod
    def backward(ctx, grad_SBHD):
        local = grad_SBHD.new_empty((grad_SBHD.shape[0] // dist.get_world_size(ctx.group), *grad_SBHD.shape[1:]))
        dist.reduce_scatter_tensor(local, grad_SBHD.contiguous(), group=ctx.group)
        return local, None


def zigzag_positions(local_len: int, cp: int, rank: int) -> torch.Tensor:
    """The positions in the whole sequence of the ``local_len`` tokens rank ``rank`` holds."""
    chunk = local_len // 2
    firsts = (rank, 2 * cp - 1 - rank)
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk) for first in firsts])


class ContextParallelAttention(torch.nn.Module):
    """Causal softmax attention over a sequence split across the context-parallel group (``pg_collection.cp``)."""

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
        k_channels=None,
        v_channels=None,
    ):  # fmt: skip  (MLA gives its key and value widths; the tensors carry them)
        super().__init__()
        from megatron.core import parallel_state

        self.config = config
        self.group = pg_collection.cp if pg_collection is not None else parallel_state.get_context_parallel_group()
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):  # fmt: skip
        assert packed_seq_params is None and attention_bias is None, "whole sequences only"
        cp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        order = torch.cat([zigzag_positions(query.shape[0], cp, r) for r in range(cp)]).argsort()
        key_SBGD = _GatherSequence.apply(key, self.group)[order]
        value_SBGD = _GatherSequence.apply(value, self.group)[order]
        repeat = query.shape[2] // key.shape[2]  # grouped-query attention
        key_SBHD = key_SBGD.repeat_interleave(repeat, dim=2)
        value_SBHD = value_SBGD.repeat_interleave(repeat, dim=2)
        scores_BHQK = torch.einsum("qbhd,kbhd->bhqk", query, key_SBHD) * self.softmax_scale
        future_QK = zigzag_positions(query.shape[0], cp, rank)[:, None] < torch.arange(key_SBHD.shape[0])[None]
        probs_BHQK = scores_BHQK.masked_fill(future_QK, float("-inf")).softmax(dim=-1)
        context_QBHD = torch.einsum("bhqk,kbhd->qbhd", probs_BHQK, value_SBHD)
        return context_QBHD.reshape(query.shape[0], query.shape[1], -1)


def with_context_parallel_attention(spec):
    """``spec`` (a local decoder block spec) with each self-attention's core attention taking context parallelism."""
    for layer in spec.layer_specs:
        attention = getattr(layer.submodules.self_attention, "submodules", None)
        if attention is not None and hasattr(attention, "core_attention"):
            attention.core_attention = ContextParallelAttention
    return spec
