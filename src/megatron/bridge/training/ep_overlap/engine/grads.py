"""Gradients after a step: which modules defer weight gradients, and the data-parallel sums."""

import torch

from megatron.bridge.utils.process_groups import EPGroups, all_reduce


def delayable_linears(chunks) -> list:
    """Modules whose wgrad the schedule may defer (``contract.DelayableLinear``), over all layers of all ``chunks``."""
    return [linear for chunk in chunks for layer in chunk.layers for linear in layer.delayable_linears()]


def sync_grads(model: torch.nn.Module, groups: EPGroups) -> None:
    """Sums non-expert grads over the DP group and expert grads over the expert-DP group, one bucket each."""
    dense, expert = [], []
    for param in model.parameters():
        if param.requires_grad:
            (expert if getattr(param, "allreduce", True) is False else dense).append(param)
    for params, group, what in ((dense, groups.dp_group, "dense"), (expert, groups.expert_dp_group, "expert")):
        if group is None or torch.distributed.get_world_size(group) == 1 or not params:
            continue
        grads = []
        for param in params:
            main_grad = getattr(param, "main_grad", None)
            if main_grad is not None:
                grads.append(main_grad)
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads.append(param.grad)
        flat = torch.cat([g.reshape(-1) for g in grads])
        all_reduce(flat, group, op=f"{what} gradient all-reduce", timeout=groups.timeout)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
