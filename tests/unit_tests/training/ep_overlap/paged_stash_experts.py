"""Test-only: routed experts that page their activations out through Megatron-Core's paged stash, for CPU ranks.

Megatron-Core stashes only in ``TEGroupedMLP._fused_forward`` (Transformer Engine's fused grouped MLP), which a CPU
has not. :class:`StashedExperts` does there what that method does around its fused op, with a torch grouped MLP
in its place:

    x_PH = paged_stash_group_start(x_PH)                   # the group's start (waits for the last stash)
    with get_paged_stash_context(max_num_tokens=P, num_tokens_tensor=tokens_per_expert_E.sum(),
                                 avg_num_tokens=P // moe_expert_rank_capacity_factor):
        out_PH = grouped MLP                               # its saved activations tagged as Transformer Engine tags
    out_PH = paged_stash_group_commit(out_PH)              # the group's end: stash now, or keep for its backward

The grouped MLP (``fc2(activation(fc1 x) * probs)``, each row by its local expert, rows in expert order as
``tokens_per_expert_E`` counts them) saves its input rows and its fc1 output, both ``[P, ...]``, with
``grouped_tensor_scale_inv = False``: what the stash pages (row-major, one row per token, the valid rows first).
Its backward reads only the experts' rows, as a grouped GEMM does: rows past them are what a reloaded stash leaves
unset. A swap of the built model's experts (:func:`use_stashed_experts`, taking their weights; reading the model's
config, as Transformer Engine's grouped MLP does, where the ``SequentialMLP`` kept a copy) rather than a spec: it
reaches every MoE layer of a ``GPTModel``, a ``HybridModel`` or a pipeline chunk alike, after the build, as
``static_hybridep.make_static`` sets the capacity factor (Megatron-Core's config refuses paged stash without it at
build time), and both arms of a comparison get the same experts with the same weights.

P permuted rows (HybridEP's static budget), H hidden, F the experts' FFN width, E local experts.
"""

from contextlib import nullcontext

import torch
from megatron.core.transformer.moe.paged_stash import (
    PagedStashManager,
    get_paged_stash_context,
    paged_stash_group_commit,
    paged_stash_group_start,
)


def _expert_of_rows(counts_E: torch.Tensor, rows: int) -> torch.Tensor:
    """Each row's local expert (rows in expert order); E for a row past the experts' tokens."""
    return torch.searchsorted(torch.cumsum(counts_E, 0), torch.arange(rows, device=counts_E.device), right=True)


def _per_expert(a_PK: torch.Tensor, w_ENK: torch.Tensor, expert_P: torch.Tensor) -> torch.Tensor:
    """Row ``p`` times its expert's ``w[e]`` transposed; zero for a row of no expert."""
    out_PN = a_PK.new_zeros((a_PK.shape[0], w_ENK.shape[1]))
    for e in range(w_ENK.shape[0]):
        out_PN = torch.where((expert_P == e)[:, None], a_PK @ w_ENK[e].t(), out_PN)
    return out_PN


def _expert_sums(a_PN: torch.Tensor, b_PK: torch.Tensor, expert_P: torch.Tensor, experts: int) -> torch.Tensor:
    """Per expert, the sum over its rows of ``a`` outer ``b``: ``[E, N, K]`` (a weight's gradient)."""
    return torch.stack([(a_PN * (expert_P == e)[:, None]).t() @ b_PK for e in range(experts)])


class _GroupedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_PH, counts_E, probs_P, fc1_EFH, fc2_EHF, activation):
        expert_P = _expert_of_rows(counts_E, x_PH.shape[0])
        fc1_PF = _per_expert(x_PH, fc1_EFH, expert_P)
        scaled_PF = activation(fc1_PF) * probs_P.to(fc1_PF.dtype)[:, None]
        # what Transformer Engine's grouped MLP marks for the stash: row-major, one row per permuted token
        x_PH.grouped_tensor_scale_inv = False
        fc1_PF.grouped_tensor_scale_inv = False
        ctx.save_for_backward(x_PH, fc1_PF, counts_E, probs_P, fc1_EFH, fc2_EHF)
        ctx.activation = activation
        return _per_expert(scaled_PF, fc2_EHF, expert_P)

    @staticmethod
    def backward(ctx, grad_PH):
        x_PH, fc1_PF, counts_E, probs_P, fc1_EFH, fc2_EHF = ctx.saved_tensors
        experts = fc1_EFH.shape[0]
        expert_P = _expert_of_rows(counts_E, x_PH.shape[0])
        kept_P1 = (expert_P < experts)[:, None]  # a grouped GEMM reads no row past the experts' tokens
        x_PH = torch.where(kept_P1, x_PH, 0)
        fc1_PF = torch.where(kept_P1, fc1_PF, 0)
        grad_PH = torch.where(kept_P1, grad_PH, 0)
        probs_P1 = probs_P.to(fc1_PF.dtype)[:, None]
        with torch.enable_grad():
            fc1 = fc1_PF.detach().requires_grad_()
            act_PF = ctx.activation(fc1)
        grad_scaled_PF = _per_expert(grad_PH, fc2_EHF.transpose(1, 2), expert_P)
        grad_fc2_EHF = _expert_sums(grad_PH, act_PF.detach() * probs_P1, expert_P, experts)
        grad_probs_P = (grad_scaled_PF * act_PF.detach()).sum(-1).to(probs_P.dtype)
        (grad_fc1_PF,) = torch.autograd.grad(act_PF, fc1, grad_scaled_PF * probs_P1)
        grad_x_PH = _per_expert(grad_fc1_PF, fc1_EFH.transpose(1, 2), expert_P)
        grad_fc1_EFH = _expert_sums(grad_fc1_PF, x_PH, expert_P, experts)
        return grad_x_PH, None, grad_probs_P, grad_fc1_EFH, grad_fc2_EHF, None


class StashedExperts(torch.nn.Module):
    """A layer's routed experts (see the module docstring), with the weights of the ``SequentialMLP`` it replaces and
    the model's ``config``, as Transformer Engine's grouped MLP reads it (the ``SequentialMLP`` holds a copy)."""

    def __init__(self, experts: torch.nn.Module, config):
        super().__init__()
        self.config = config
        assert not self.config.gated_linear_unit and not self.config.add_bias_linear, "a plain fc1-act-fc2 expert"
        local = list(experts.local_experts)
        self.weight1_EFH = torch.nn.Parameter(torch.stack([e.linear_fc1.weight.detach() for e in local]))
        self.weight2_EHF = torch.nn.Parameter(torch.stack([e.linear_fc2.weight.detach() for e in local]))

    def forward(self, x_PH: torch.Tensor, tokens_per_expert_E: torch.Tensor, probs_P: torch.Tensor):
        config = self.config
        stashed = config.moe_paged_stash
        context = nullcontext()
        if stashed:
            x_PH = paged_stash_group_start(x_PH)
            budget, factor = x_PH.shape[0], config.moe_expert_rank_capacity_factor
            context = get_paged_stash_context(
                name="grouped_mlp",
                max_num_tokens=budget,
                num_tokens_tensor=tokens_per_expert_E.sum(),
                avg_num_tokens=int(budget // factor) if factor else None,
            )
        with context:
            args = (x_PH, tokens_per_expert_E, probs_P, self.weight1_EFH, self.weight2_EHF, config.activation_func)
            out_PH = _GroupedMLP.apply(*args)
        if stashed:
            out_PH = paged_stash_group_commit(out_PH, name="grouped_mlp")
        return out_PH, None

    def backward_dw(self) -> None:
        """Nothing delayed: the weight gradients come with the backward."""


def use_stashed_experts(model: torch.nn.Module) -> None:
    """Every MoE layer of ``model`` computes with :class:`StashedExperts` (its experts' weights)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for module in model.modules():
        if isinstance(module, MoELayer) and not isinstance(module.experts, StashedExperts):
            module.experts = StashedExperts(module.experts, module.config)


def enable_paged_stash(model: torch.nn.Module, *, page_size: int = 4, factor: float = 4.0) -> None:
    """Turns paged stash on in ``model``'s config, after the build (with the capacity factor it needs, set by
    ``make_static``): pages of ``page_size`` rows, a device buffer of ``factor`` times the expected peak (a factor of
    the capacity factor or more never overflows), no pinned host buffer (that needs CUDA)."""
    config = model.config
    config.moe_paged_stash = True
    config.moe_paged_stash_page_size = page_size
    config.moe_paged_stash_buffer_size_factor_cuda = factor
    config.moe_paged_stash_buffer_size_factor_cpu = 0.0


def fresh_stash_manager() -> PagedStashManager:
    """A new process-wide stash manager (one per arm: it records each arm's own order in its first step)."""
    PagedStashManager.STASH_MGR = None
    return PagedStashManager.get_instance()
