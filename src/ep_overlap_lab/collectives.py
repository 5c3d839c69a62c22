"""Blocking collectives the lab runs itself (the reference model's all-to-all, the engine's gradient and count
all-reduces), each under the groups' timeout, as the payload's waits are (``process_groups.wait_work``)."""

from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.bridge.utils.process_groups import wait_work


def all_to_all(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup,
    *,
    op: str,
    timeout: timedelta,
) -> torch.Tensor:
    """Blocking uneven all-to-all of rows under a timeout."""
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group, async_op=True)
    wait_work(work, op=op, timeout=timeout)
    return out


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup, *, op: str, timeout: timedelta) -> None:
    """Blocking sum all-reduce under a timeout."""
    work = dist.all_reduce(x, group=group, async_op=True)
    wait_work(work, op=op, timeout=timeout)
