"""Test-only: DeepEP's fused dispatch and combine contracts on gloo, so Megatron-Core's flex dispatcher runs on CPU.

Megatron-Core's flex backends call autograd functions from ``megatron.core.transformer.moe.fused_a2a``, present only
where ``deep_ep`` is installed. These do what they do, with ``all_to_all_single`` in place of DeepEP's kernels:

    deepep   fused_dispatch(x_TH, indices_TK, probs_TK, num_experts, group, ...)
                 -> recv_x_RH, recv_indices_RK, recv_probs_RK, tokens_per_expert_E, handle
             Each token goes once to every rank that holds one of its experts (in token order, from each source
             rank in rank order); the received indices are local expert numbers, -1 where the expert is on another
             rank (the probability there is 0). Backward: a combine of the gradients.
             fused_combine(x_RH, group, handle, ...) -> (x_TH, None)
             The reverse: every received row goes back to its source token, and a token's rows are summed in rank
             order. Backward: a dispatch of the gradient.
    hybridep hybrid_ep_dispatch(x_TH, routing_map_TN, probs_TN, group, num_local_experts, ...)
                 -> rows_PH, probs_P, None, tokens_per_expert_E, handle
             The same movement, then the rows permuted expert by expert (a row once per local expert it chose), each
             with its probability for that expert. hybrid_ep_combine(rows_PH, handle, ...) -> x_TH: each received
             row sums its experts' outputs, then goes back as above.

T tokens, H hidden, K top-k, N experts, R rows received, P permuted rows, E local experts. The sums are in a fixed
order, so the plain path and the schedule running the same fake are bitwise comparable. :func:`install_fake_deepep`
puts them into Megatron-Core's token dispatcher module (call it in the forked test rank, before building the model).
"""

from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

CALLS: Counter = Counter()  # how often each fused function (and its backward) ran in this process


@dataclass
class _Handle:
    rows_S: torch.Tensor  # the source token of each row sent, in send order
    send_counts: list[int]  # rows sent to each rank
    recv_counts: list[int]  # rows received from each rank
    num_tokens: int


def _all_to_all(x: torch.Tensor, out_counts: list[int], in_counts: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_counts),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_counts, in_counts, group=group)
    return out


def _send(x: torch.Tensor, handle: _Handle, group) -> torch.Tensor:
    return _all_to_all(x[handle.rows_S], handle.recv_counts, handle.send_counts, group)


def _sum_segments(x: torch.Tensor, targets: torch.Tensor, counts: list[int], size: int) -> torch.Tensor:
    """Rows of ``x`` added into ``size`` rows at ``targets``, one segment after the other (a target appears at most
    once per segment), so the order of the additions is fixed."""
    summed = x.new_zeros((size,) + tuple(x.shape[1:]))
    start = 0
    for count in counts:
        rows = targets[start : start + count]
        summed[rows] = summed[rows] + x[start : start + count]
        start += count
    return summed


def _return(x: torch.Tensor, handle: _Handle, group) -> torch.Tensor:
    """Received rows back to their source tokens, a token's rows summed rank by rank."""
    back = _all_to_all(x, handle.send_counts, handle.recv_counts, group)
    return _sum_segments(back, handle.rows_S, handle.send_counts, handle.num_tokens)


def _exchange(rows: list[torch.Tensor], about: list[tuple[torch.Tensor, ...]], group, device):
    """Sends, to each rank, the tokens ``rows[rank]`` names and the tensors ``about[rank]`` that describe them: the
    counts first, then the tensors. Returns the tokens sent (in send order), the counts sent and received, and the
    tensors received."""
    send_counts = [len(r) for r in rows]
    recv_counts_W = torch.empty(group.size(), dtype=torch.int64, device=device)
    dist.all_to_all_single(recv_counts_W, torch.tensor(send_counts, device=device), group=group)
    recv_counts = recv_counts_W.tolist()
    received = [_all_to_all(torch.cat(parts), recv_counts, send_counts, group) for parts in zip(*about)]
    return torch.cat(rows), send_counts, recv_counts, received


class _FusedDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, indices_TK, probs_TK, num_experts, group, async_finish=False, allocate=False):
        CALLS["dispatch"] += 1
        world = group.size()
        local = num_experts // world
        owner_TK = torch.where(indices_TK >= 0, indices_TK // local, -1)
        rows, about = [], []
        for dest in range(world):
            mine_TK = owner_TK == dest
            tokens = mine_TK.any(dim=1).nonzero().flatten()
            rows.append(tokens)
            about.append((torch.where(mine_TK, indices_TK - dest * local, -1)[tokens],
                          torch.where(mine_TK, probs_TK, 0.0)[tokens]))  # fmt: skip
        rows_S, send_counts, recv_counts, (recv_indices, recv_probs) = _exchange(rows, about, group, x_TH.device)
        handle = _Handle(rows_S, send_counts, recv_counts, x_TH.shape[0])
        recv_x = _send(x_TH, handle, group)
        tokens_per_expert = torch.stack([(recv_indices == e).sum() for e in range(local)]).cpu()  # as DeepEP's
        ctx.group, ctx.handle = group, handle
        ctx.mark_non_differentiable(recv_indices, tokens_per_expert)
        return recv_x, recv_indices, recv_probs, tokens_per_expert, handle

    @staticmethod
    def backward(ctx, grad_x, grad_indices, grad_probs, grad_counts, grad_handle):
        CALLS["dispatch_bwd"] += 1
        return (
            _return(grad_x, ctx.handle, ctx.group),
            None,
            _return(grad_probs.float(), ctx.handle, ctx.group),
            None,
            None,
            None,
            None,
        )


class _FusedCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RH, group, handle, async_finish=False, allocate=False):
        CALLS["combine"] += 1
        ctx.group, ctx.handle = group, handle
        return _return(x_RH, handle, group), None

    @staticmethod
    def backward(ctx, grad_x, grad_none):
        CALLS["combine_bwd"] += 1
        return _send(grad_x, ctx.handle, ctx.group), None, None, None, None


@dataclass
class _PermutedHandle(_Handle):
    recv_rows_P: torch.Tensor  # the received row of each permuted row, expert by expert
    expert_counts: list[int]  # permuted rows per local expert
    num_experts: int
    group: object  # the combine finds it on the handle, as HybridEP's buffer keeps it


def _exchange_routed(x_TH, routing_TN, probs_TN, group, local: int):
    """Each token, with its routing and probabilities for the destination's experts, to every rank that holds one of
    its experts."""
    rows, about = [], []
    for dest in range(group.size()):
        experts = slice(dest * local, (dest + 1) * local)
        tokens = routing_TN[:, experts].any(dim=1).nonzero().flatten()
        rows.append(tokens)
        about.append((routing_TN[tokens, experts].to(torch.int64), probs_TN[tokens, experts]))
    rows_S, send_counts, recv_counts, (routes_RE, probs_RE) = _exchange(rows, about, group, x_TH.device)
    return rows_S, send_counts, recv_counts, routes_RE.bool(), probs_RE


def _by_expert(rows_RH: torch.Tensor, handle: _PermutedHandle) -> torch.Tensor:
    return rows_RH[handle.recv_rows_P]


def _sum_by_row(rows_PH: torch.Tensor, handle: _PermutedHandle, received: int) -> torch.Tensor:
    """Permuted rows back to their received rows, a row's experts summed expert by expert."""
    return _sum_segments(rows_PH, handle.recv_rows_P, handle.expert_counts, received)


class _HybridDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, routing_TN, probs_TN, group, local):
        CALLS["dispatch"] += 1
        rows_S, send_counts, recv_counts, routes_RE, probs_RE = _exchange_routed(
            x_TH, routing_TN, probs_TN, group, local
        )
        per_expert = [routes_RE[:, e].nonzero().flatten() for e in range(local)]
        handle = _PermutedHandle(
            rows_S, send_counts, recv_counts, x_TH.shape[0], torch.cat(per_expert), [len(r) for r in per_expert],
            routing_TN.shape[1], group,
        )  # fmt: skip
        experts_P = torch.cat([torch.full((len(r),), e, dtype=torch.int64) for e, r in enumerate(per_expert)])
        recv_x = _send(x_TH, handle, group)
        tokens_per_expert = torch.tensor(handle.expert_counts)
        ctx.group, ctx.handle, ctx.experts_P, ctx.received = group, handle, experts_P, recv_x.shape[0]
        ctx.mark_non_differentiable(tokens_per_expert)
        return _by_expert(recv_x, handle), probs_RE[handle.recv_rows_P, experts_P], None, tokens_per_expert, handle

    @staticmethod
    def backward(ctx, grad_x, grad_probs, grad_scaling, grad_counts, grad_handle):
        CALLS["dispatch_bwd"] += 1
        handle, group, local = ctx.handle, ctx.group, len(ctx.handle.expert_counts)
        grad_x_TH = _return(_sum_by_row(grad_x, handle, ctx.received), handle, group)
        grad_probs_RE = grad_probs.new_zeros((ctx.received, local))
        grad_probs_RE[handle.recv_rows_P, ctx.experts_P] = grad_probs
        back_SE = _all_to_all(grad_probs_RE, handle.send_counts, handle.recv_counts, group)
        grad_probs_TN = back_SE.new_zeros((handle.num_tokens, handle.num_experts))
        start = 0
        for dest, count in enumerate(handle.send_counts):  # a token is sent at most once to each rank
            grad_probs_TN[handle.rows_S[start : start + count], dest * local : (dest + 1) * local] = back_SE[
                start : start + count
            ]
            start += count
        return grad_x_TH, None, grad_probs_TN, None, None


class _HybridCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_PH, handle):
        CALLS["combine"] += 1
        ctx.handle, ctx.received = handle, sum(handle.recv_counts)
        return _return(_sum_by_row(x_PH, handle, ctx.received), handle, handle.group)

    @staticmethod
    def backward(ctx, grad_x):
        CALLS["combine_bwd"] += 1
        return _by_expert(_send(grad_x, ctx.handle, ctx.handle.group), ctx.handle), None


def hybrid_ep_dispatch(x, routing_map, probs, group, num_local_experts, *args, **kwargs):
    return _HybridDispatch.apply(x, routing_map, probs, group, num_local_experts)


def hybrid_ep_combine(x, handle, num_permuted_tokens=None, pad_multiple=None, fused=False):
    return _HybridCombine.apply(x, handle)


def fused_dispatch(
    x, token_indices, token_probs, num_experts, group, async_finish=False, allocate_on_comm_stream=False
):
    return _FusedDispatch.apply(x.contiguous(), token_indices, token_probs, num_experts, group)


def fused_combine(x, group, handle, async_finish=False, allocate_on_comm_stream=False):
    return _FusedCombine.apply(x, group, handle)


def install_fake_deepep() -> None:
    """Megatron-Core's flex dispatcher (backends ``deepep`` and ``hybridep``) calls the functions above from now
    on, in this process.

    ``dispatch_preprocess`` is compiled with ``torch.compile`` where Megatron-Core's JIT fuser is on; on CPU it runs
    eagerly (both arms of every comparison run the same code)."""
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.fused_dispatch = fused_dispatch
    token_dispatcher.fused_combine = fused_combine
    token_dispatcher.hybrid_ep_dispatch = hybrid_ep_dispatch
    token_dispatcher.hybrid_ep_combine = hybrid_ep_combine
    token_dispatcher.set_deepep_num_sms = lambda num_sms: None
    torch._dynamo.config.disable = True


def dispatcher_names(model: torch.nn.Module) -> set[str]:
    """The token dispatcher classes of ``model``'s MoE layers."""
    return {type(m.token_dispatcher).__name__ for m in model.modules() if hasattr(m, "token_dispatcher")}
