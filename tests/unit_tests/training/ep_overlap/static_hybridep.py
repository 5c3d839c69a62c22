"""Test-only: HybridEP's static-shape contract on gloo (``moe_expert_rank_capacity_factor`` set), with no host read.

With a capacity factor Megatron-Core's HybridEP manager passes ``num_permuted_tokens``, a budget of permuted rows
fixed by the shapes, and HybridEP then needs no split sizes on the host: its rows are ``[budget, H]``, its counts per
local expert stay on the device, and a flag on the handle says whether tokens were dropped over the budget. These
functions do the same with equal-split ``all_to_all_single`` calls and index arithmetic only (no ``nonzero``,
``tolist``, ``item`` or a tensor's truth value), so every step issues the same operations on the same shapes,
whatever the routing:

    dispatch(x_TH, routing_map_TN, probs_TN, group, num_local_experts, num_permuted_tokens=P)
        -> rows_PH, probs_P, None, tokens_per_expert_E, handle
        Every rank sends all its T tokens to every rank, each with its routing and probabilities for that rank's
        experts (R = ranks x T rows received); the received rows are permuted expert by expert, in received order,
        into P rows (the rest zeros, probability 0). ``handle[-1]``: 1 where the routed rows exceeded P.
    combine(rows_PH, handle) -> x_TH
        Each received row sums its experts' outputs, expert by expert; the rows go back to their source rank, and a
        token sums what each rank sent back, rank by rank.

Without a budget (``num_permuted_tokens=None``: no capacity factor, as after Megatron-Core's ``PagedStashRunner``
clears it to rerun an overflowed step) P is the number of rows routed here, read on the host as HybridEP's dynamic
path does (``CALLS["dispatch_dynamic"]`` counts those dispatches).

T tokens, H hidden, N experts, E local experts, R received rows, P the budget. :func:`install_static_hybridep` puts
them into Megatron-Core's token dispatcher module, and :func:`make_static` sets the capacity factor on a built
model's HybridEP managers (Megatron-Core's config asks for Transformer Engine's op fuser with it, so it is set after
the build).
"""

import torch
import torch.distributed as dist

from .fake_deepep import CALLS


class _Handle(tuple):
    """(positions_RE, group, over_budget): where each received row's expert rows went (P: nowhere), the group the
    combine sends on, and the drop flag (last, where Megatron-Core reads it)."""

    @property
    def positions_RE(self) -> torch.Tensor:
        return self[0]

    @property
    def group(self):
        return self[1]


def _to_every_rank(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` (T rows) to every rank; returns the T rows of each rank, rank by rank (R = ranks x T)."""
    world = group.size()
    out = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.repeat((world,) + (1,) * (x.dim() - 1)).contiguous(), group=group)
    return out


def _back_to_sources(x_RH: torch.Tensor, group) -> torch.Tensor:
    """The reverse of :func:`_to_every_rank`: each rank's rows back, summed rank by rank (a fixed order)."""
    world = group.size()
    out = torch.empty_like(x_RH)
    dist.all_to_all_single(out, x_RH.contiguous(), group=group)
    rows = out.shape[0] // world
    total = out[:rows].clone()
    for rank in range(1, world):
        total = total + out[rank * rows : (rank + 1) * rows]
    return total


def _positions(routes_RE: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each (received row, local expert) pair's permuted row: expert by expert, in received order; ``budget`` (one
    past the last row) where the row did not choose the expert or the budget is spent. And the over-budget flag."""
    routes = routes_RE.to(torch.int64)
    per_expert_E = routes.sum(dim=0)
    first_E = torch.cumsum(per_expert_E, dim=0) - per_expert_E
    within_RE = torch.cumsum(routes, dim=0) - routes
    positions_RE = torch.where(routes_RE, first_E + within_RE, budget)
    over = positions_RE >= budget
    positions_RE = torch.where(over, budget, positions_RE)
    return positions_RE, (over & routes_RE).any().to(torch.int32).reshape(1)


def _permute(rows_RH: torch.Tensor, positions_RE: torch.Tensor, budget: int) -> torch.Tensor:
    """Rows into their permuted places, ``[budget, ...]``; one spare row takes what goes nowhere, then is cut."""
    out = rows_RH.new_zeros((budget + 1,) + tuple(rows_RH.shape[1:]))
    for expert in range(positions_RE.shape[1]):
        out = out.index_copy(0, positions_RE[:, expert], rows_RH)
    return out[:budget]


def _gather_sum(rows_PH: torch.Tensor, positions_RE: torch.Tensor) -> torch.Tensor:
    """Each received row: the sum of its experts' permuted rows, expert by expert (zero where it chose none)."""
    padded = torch.cat([rows_PH, rows_PH.new_zeros((1,) + tuple(rows_PH.shape[1:]))])
    total = padded[positions_RE[:, 0]]
    for expert in range(1, positions_RE.shape[1]):
        total = total + padded[positions_RE[:, expert]]
    return total


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, routing_TN, probs_TN, group, local, budget):
        CALLS["dispatch"] += 1
        rank, tokens = dist.get_rank(group), x_TH.shape[0]
        experts = slice(rank * local, (rank + 1) * local)
        x_RH = _to_every_rank(x_TH, group)
        # every rank sends its tokens' routing for all experts; each keeps the columns of its own
        routes_RE = _to_every_rank(routing_TN.to(torch.int64), group)[:, experts].bool()
        probs_RE = _to_every_rank(probs_TN.float(), group)[:, experts]
        if budget is None:  # the dynamic path: as many rows as were routed here
            CALLS["dispatch_dynamic"] += 1
            budget = int(routes_RE.sum())
        positions_RE, over = _positions(routes_RE, budget)
        rows_PH = _permute(x_RH, positions_RE, budget)
        probs_P = probs_RE.new_zeros(budget + 1)
        for expert in range(local):  # each expert's probability goes to that expert's row
            probs_P = probs_P.index_copy(0, positions_RE[:, expert], probs_RE[:, expert])
        probs_P = probs_P[:budget]
        tokens_per_expert_E = torch.minimum(routes_RE.to(torch.int64).sum(dim=0), torch.tensor(budget))
        ctx.group, ctx.local, ctx.tokens, ctx.positions_RE = group, local, tokens, positions_RE
        ctx.mark_non_differentiable(tokens_per_expert_E)
        return rows_PH, probs_P, None, tokens_per_expert_E, _Handle((positions_RE, group, over))

    @staticmethod
    def backward(ctx, grad_rows_PH, grad_probs_P, grad_none, grad_counts, grad_handle):
        CALLS["dispatch_bwd"] += 1
        group, local = ctx.group, ctx.local
        grad_x_TH = _back_to_sources(_gather_sum(grad_rows_PH, ctx.positions_RE), group)
        padded = torch.cat([grad_probs_P, grad_probs_P.new_zeros(1)])
        grad_probs_RE = torch.stack([padded[ctx.positions_RE[:, e]] for e in range(local)], dim=1)
        world, rank = group.size(), dist.get_rank(group)
        wide_RN = grad_probs_RE.new_zeros((grad_probs_RE.shape[0], world * local))
        wide_RN[:, rank * local : (rank + 1) * local] = grad_probs_RE
        return grad_x_TH, None, _back_to_sources(wide_RN, group), None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows_PH, handle):
        CALLS["combine"] += 1
        ctx.handle, ctx.group, ctx.budget = handle, handle.group, rows_PH.shape[0]
        return _back_to_sources(_gather_sum(rows_PH, handle.positions_RE), handle.group)

    @staticmethod
    def backward(ctx, grad_x_TH):
        CALLS["combine_bwd"] += 1
        grad_RH = _to_every_rank(grad_x_TH, ctx.group)
        return _permute(grad_RH, ctx.handle.positions_RE, ctx.budget), None


def static_dispatch(x, routing_map, probs, group, num_local_experts, *args, num_permuted_tokens=None, **kwargs):
    budget = None if num_permuted_tokens is None else int(num_permuted_tokens)
    return _Dispatch.apply(x, routing_map, probs, group, num_local_experts, budget)


def static_combine(x, handle, num_permuted_tokens=None, pad_multiple=None, fused=False):
    return _Combine.apply(x, handle)


def install_static_hybridep() -> None:
    """Megatron-Core's HybridEP backend calls the static functions above from now on, in this process."""
    from .fake_deepep import install_fake_deepep

    install_fake_deepep()
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.hybrid_ep_dispatch = static_dispatch
    token_dispatcher.hybrid_ep_combine = static_combine


def make_static(model: torch.nn.Module, capacity_factor: float = 4.0) -> None:
    """Sets ``moe_expert_rank_capacity_factor`` (and the op fuser it goes with) on ``model``'s config and its HybridEP
    managers (see above)."""
    model.config.moe_expert_rank_capacity_factor = capacity_factor
    # What Megatron-Core asks with a capacity factor (its budget is rounded to the fused grouped GEMM's alignment).
    model.config.use_transformer_engine_op_fuser = True
    for module in model.modules():
        manager = getattr(getattr(module, "token_dispatcher", None), "_comm_manager", None)
        if manager is not None:
            manager.moe_expert_rank_capacity_factor = capacity_factor
