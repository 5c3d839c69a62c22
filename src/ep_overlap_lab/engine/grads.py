"""Gradients after a step: which modules defer weight gradients, and the data-parallel sums."""

import torch

from ep_overlap_lab.collectives import all_reduce
from megatron.bridge.utils.process_groups import EPGroups


def delayable_linears(chunks) -> list:
    """Modules whose wgrad the schedule may defer (``wgrad_store.DelayableLinear``), over every layer of ``chunks``."""
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


class HeldGradients:
    """What the parameters' gradients held before a step, set aside so that the step computes and syncs its own
    contribution alone, then added back: ``step()`` accumulates into ``.grad`` (or ``main_grad``) as autograd and
    Megatron-Core's gradient buffers do, and the all-reduce never sums an earlier step's gradient again.

    k steps without zeroing give, bitwise, the sum of the k steps' own gradients taken in step order.
    """

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]]):
        self.names = [name for name, _ in named_params]
        self.params = params = [param for _, param in named_params]
        mains = [p.main_grad for p in params if getattr(p, "main_grad", None) is not None]
        nonzero = iter(torch.stack([m.any() for m in mains]).tolist() if mains else [])  # one host sync
        self.held = []
        for param in params:
            main = getattr(param, "main_grad", None)
            if main is not None:
                self.held.append(main.clone() if next(nonzero) else None)
                main.zero_()
            else:
                self.held.append(param.grad)
                param.grad = None

    def restore(self, *, add: bool) -> None:
        """``add``: put the earlier gradients back under this step's (old + new); else put them back as they were,
        dropping whatever a failed step left."""
        for param, old in zip(self.params, self.held):
            main = getattr(param, "main_grad", None)
            if main is not None:
                if old is not None:
                    main.add_(old) if add else main.copy_(old)
                elif not add:
                    main.zero_()
            elif not add or param.grad is None:
                param.grad = old
            elif old is not None:
                param.grad = old.add_(param.grad)

    def contributions(self) -> list[tuple[str, torch.Tensor]]:
        """This step's gradient of each parameter that has one (before ``restore``), by name."""
        grads = [p.main_grad if getattr(p, "main_grad", None) is not None else p.grad for p in self.params]
        return [(name, grad) for name, grad in zip(self.names, grads) if grad is not None]
