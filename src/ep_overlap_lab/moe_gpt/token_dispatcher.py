"""Expert-parallel token routing metadata and the all-to-all token dispatcher of the reference MoE GPT.

A microbatch's tokens are replicated top-k times and permuted so that (token, k) slots are grouped by expert.
Experts are spread over the EP group in contiguous blocks (rank r owns global experts
``r * E_local ... (r + 1) * E_local - 1``), so rows grouped by expert are grouped by destination rank too.

Every gather here is by a permutation (unique indices), whose backward adds each gradient row exactly once.
That keeps results bitwise reproducible, also on CUDA where index_add uses atomics.

Shape suffixes: T tokens of the microbatch, K top-k, P = T*K permuted slots, R rows received by this rank,
D hidden size, E experts, L local experts.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ep_overlap_lab.collectives import all_to_all
from megatron.bridge.utils.process_groups import EPGroups, exchanged_bytes, wait_work


@dataclass
class Routing:
    """Where one microbatch's tokens go in one MoE layer; built in pre_dispatch, completed by split exchange."""

    order_P: torch.Tensor  # permutation: slot index (t * K + k) in expert-sorted order
    inverse_P: torch.Tensor  # inverse of order_P
    counts_E: torch.Tensor  # tokens this rank sends to each global expert (device tensor until exchanged)
    num_local_experts: int
    ep_size: int
    # Host-side values, filled by exchange_splits():
    in_splits: list[int] = field(default_factory=list)  # rows sent to each EP rank
    out_splits: list[int] = field(default_factory=list)  # rows received from each EP rank
    local_group_sizes: list[int] = field(default_factory=list)  # received rows per local expert
    sort_R: torch.Tensor | None = None  # received (source rank, local expert) order -> (local expert, source) order
    unsort_R: torch.Tensor | None = None
    # Set by start_split_exchange(): the counts on their way (host copy, CUDA copy event, gloo work and its buffer).
    counts_host: torch.Tensor | None = None
    counts_copied: object = None
    counts_in_flight: tuple | None = None
    # Set by exchange_splits(): the counts sent and received per (EP rank, local expert), on the host (what a
    # replayed forward of full recompute reuses instead of exchanging again: ``replay_splits``).
    exchanged: tuple[list[list[int]], list[list[int]]] | None = None

    @classmethod
    def build(cls, experts_TK: torch.Tensor, num_experts: int, ep_size: int) -> "Routing":
        flat_P = experts_TK.reshape(-1)
        order_P = torch.argsort(flat_P, stable=True)
        inverse_P = torch.empty_like(order_P)
        inverse_P[order_P] = torch.arange(order_P.numel(), device=order_P.device)
        counts_E = torch.bincount(flat_P, minlength=num_experts)
        return cls(order_P, inverse_P, counts_E, num_experts // ep_size, ep_size)


# (op, "start" | "end", bytes this rank sends to others, bytes it receives), around each blocking all-to-all
CommObserver = Callable[[str, str, int, int], None]


def start_split_exchange(routing: Routing, groups: EPGroups) -> None:
    """Sends this rank's counts without blocking the host; :func:`exchange_splits` finishes the exchange.

    On CPU the counts go out at once (gloo async work on the metadata group). On CUDA the device-to-host copy is
    queued behind the router's kernels, so the host can queue more work before it waits for the copy; the counts
    go out when the exchange is finished. Once per routing; a second call does nothing.
    """
    if routing.counts_host is not None:
        return
    L, ep = routing.num_local_experts, routing.ep_size
    if routing.counts_E.is_cuda:
        routing.counts_host = torch.empty((ep, L), dtype=routing.counts_E.dtype, pin_memory=True)
        routing.counts_host.copy_(routing.counts_E.view(ep, L), non_blocking=True)
        routing.counts_copied = torch.cuda.Event()
        routing.counts_copied.record()
        return
    routing.counts_host = routing.counts_E.view(ep, L)
    if groups.ep_meta_group is not None:  # row r of the counts goes to EP rank r
        received = torch.empty_like(routing.counts_host)
        work = dist.all_to_all_single(
            received, routing.counts_host.contiguous(), [1] * ep, [1] * ep, group=groups.ep_meta_group, async_op=True
        )
        routing.counts_in_flight = (work, received)


def exchange_splits(routing: Routing, groups: EPGroups, *, op: str, observer: CommObserver | None = None) -> None:
    """Tells every EP rank how many rows it receives per local expert; fills the host-side split sizes.

    This is the host sync of the dispatch (device counts to host), run on the gloo metadata group; it finishes what
    :func:`start_split_exchange` began, or runs all of it. ``observer`` sees the round trip as the all-to-all
    ``split_exchange``.
    """
    L, ep = routing.num_local_experts, routing.ep_size
    if observer is not None and groups.ep_meta_group is not None:
        observer("split_exchange", "start", *exchanged_bytes(routing.counts_E.view(ep, L), [1] * ep, [1] * ep,
                                                             groups.ep_rank))  # fmt: skip
    start_split_exchange(routing, groups)
    if routing.counts_copied is not None:
        routing.counts_copied.synchronize()
    send_counts = routing.counts_host
    if groups.ep_meta_group is None:
        recv_counts = send_counts
    elif routing.counts_in_flight is not None:
        work, recv_counts = routing.counts_in_flight
        wait_work(work, op=op, timeout=groups.timeout)
    else:
        recv_counts = all_to_all(send_counts, [1] * ep, [1] * ep, groups.ep_meta_group, op=op, timeout=groups.timeout)
    routing.counts_host = routing.counts_copied = routing.counts_in_flight = None
    if observer is not None and groups.ep_meta_group is not None:
        observer("split_exchange", "end", 0, 0)
    _complete(routing, send_counts.tolist(), recv_counts.tolist())


def replay_splits(routing: Routing, exchanged: tuple[list[list[int]], list[list[int]]], *, where: str) -> None:
    """Completes a replayed forward's ``routing`` (full recompute) with the counts its first forward exchanged
    (``Routing.exchanged``), without communicating: every rank replays the same routing, so its peers' counts are
    the same too.

    Raises:
        RuntimeError: When the replayed router sends other counts than the first forward did (routing that is not
            deterministic would receive rows of the wrong size).
    """
    L, ep = routing.num_local_experts, routing.ep_size
    sent = routing.counts_E.view(ep, L).tolist()
    if sent != exchanged[0]:
        raise RuntimeError(
            f"{where}: the replayed router sends {sent} tokens per (EP rank, expert), its first forward sent "
            f"{exchanged[0]}; full recompute needs deterministic routing (same inputs, same expert bias)"
        )
    _complete(routing, *exchanged)


def _complete(routing: Routing, send: list[list[int]], counts: list[list[int]]) -> None:
    """Fills the host-side split sizes and the received rows' expert order from the exchanged counts."""
    L, ep = routing.num_local_experts, routing.ep_size
    routing.exchanged = (send, counts)
    routing.in_splits = [sum(row) for row in send]
    routing.out_splits = [sum(row) for row in counts]
    routing.local_group_sizes = [sum(row[le] for row in counts) for le in range(L)]
    # Received rows come in (source rank, local expert) blocks; experts want (local expert, source rank).
    starts, offset = [], 0
    for row in counts:
        starts.append([])
        for count in row:
            starts[-1].append(offset)
            offset += count
    device = routing.order_P.device
    blocks = [
        torch.arange(starts[src][le], starts[src][le] + counts[src][le], device=device)
        for le in range(L)
        for src in range(ep)
    ]
    routing.sort_R = torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.long, device=device)
    routing.unsort_R = torch.empty_like(routing.sort_R)
    routing.unsort_R[routing.sort_R] = torch.arange(routing.sort_R.numel(), device=device)


class _AllToAll(torch.autograd.Function):
    """Blocking all-to-all whose backward is the reverse all-to-all: the plain (non-overlapped) path."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, groups, op, where, observer):
        ctx.splits, ctx.groups, ctx.op, ctx.where, ctx.observer = (out_splits, in_splits), groups, op, where, observer
        return _observed(x, out_splits, in_splits, groups, op, where, observer)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = _observed(grad, in_splits, out_splits, ctx.groups, f"{ctx.op}_bwd", ctx.where, ctx.observer)
        return back, None, None, None, None, None, None


def _observed(x, out_splits, in_splits, groups: EPGroups, op: str, where: str, observer) -> torch.Tensor:
    if observer is not None:
        sent, received = exchanged_bytes(x, out_splits, in_splits, groups.ep_rank)
        observer(op, "start", sent, received)
    out = all_to_all(x, out_splits, in_splits, groups.ep_group, op=f"{where} {op}", timeout=groups.timeout)
    if observer is not None:
        observer(op, "end", 0, 0)
    return out


def all_to_all_with_grad(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    groups: EPGroups,
    *,
    op: str,
    where: str,
    observer: CommObserver | None = None,
) -> torch.Tensor:
    """Differentiable uneven all-to-all over the EP group (identity with EP = 1).

    ``op`` names the all-to-all ("dispatch", "combine"; backward appends "_bwd"), ``where`` the layer; both
    appear in a timeout error.
    """
    if groups.ep_group is None:
        return x
    return _AllToAll.apply(x, out_splits, in_splits, groups, op, where, observer)


def permute(n_TD: torch.Tensor, routing: Routing, topk: int) -> torch.Tensor:
    """Replicates each token top-k times and orders the slots by expert: [T, D] -> [P, D]."""
    T, D = n_TD.shape
    slots_PD = n_TD.unsqueeze(1).expand(T, topk, D).reshape(T * topk, D)
    return slots_PD.index_select(0, routing.order_P)


def unpermute(back_PD: torch.Tensor, probs_TK: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Undoes :func:`permute` and sums each token's top-k expert outputs weighted by router probs: [P, D] -> [T, D]."""
    T, K = probs_TK.shape
    y_TKD = back_PD.index_select(0, routing.inverse_P).view(T, K, back_PD.shape[-1])
    return (y_TKD * probs_TK.unsqueeze(-1)).sum(dim=1)
