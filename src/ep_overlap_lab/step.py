"""A Megatron-Bridge-style step: ``forward_step`` with ``return_schedule_plan``, and a ``train_step`` that picks
the EP-overlap schedule when ``overlap_moe_expert_parallel_comm`` is on.

Contract:
    * ``forward_step(state, data_iterator, model)`` runs one microbatch the plain way and returns
      ``(loss, loss_func)``, as Bridge's does.
    * ``forward_step(..., return_schedule_plan=True)`` runs nothing: it returns ``(MicrobatchPlan, loss_func)``,
      the microbatch's data bound to the model, for a schedule that interleaves microbatches itself.
    * ``train_step`` asks ``forward_step`` for one plan per microbatch when the model config has
      ``overlap_moe_expert_parallel_comm`` on, and runs them through :class:`EPOverlapEngine` (checking the same
      rules as ``CommOverlapConfig.setup``); otherwise it runs the plain path. Either way the gradients are
      accumulated and synchronized, and the loss of every microbatch is returned.
    * ``model`` is a reference ``MoEGPTModel`` or a :class:`~megatron.bridge.training.ep_overlap.mcore.McoreGPTChunk`.
      ``state`` is accepted for signature compatibility with Bridge and not read.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ep_overlap_lab.engine import StepResult
from ep_overlap_lab.engine.ep_overlap_engine import EPOverlapEngine
from megatron.bridge.utils.process_groups import EPGroups


@dataclass
class MicrobatchPlan:
    """One microbatch for a schedule that runs microbatches itself."""

    model: Any
    tokens: torch.Tensor
    labels: torch.Tensor


def loss_func(loss: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bridge-style loss function: the loss and what to log."""
    return loss, {"lm loss": loss.detach()}


def forward_step(
    state: Any, data_iterator: Iterator, model: Any, return_schedule_plan: bool = False
) -> tuple[Any, Callable]:
    """One microbatch from ``data_iterator`` (``(tokens, labels)`` pairs).

    Returns:
        ``(MicrobatchPlan, loss_func)`` with ``return_schedule_plan``, else ``(loss, loss_func)`` where ``loss`` is
        the token-summed cross-entropy of the microbatch divided by its token count.
    """
    tokens, labels = next(data_iterator)
    if return_schedule_plan:
        return MicrobatchPlan(model, tokens, labels), loss_func
    return model(tokens, labels, float(tokens.numel())), loss_func


def train_step(
    forward_step_func: Callable,
    data_iterator: Iterator,
    model: Any,
    groups: EPGroups,
    num_microbatches: int,
    state: Any = None,
) -> StepResult:
    """Forward and backward over ``num_microbatches`` microbatches, with EP overlap if the model config asks."""
    plans = [
        forward_step_func(state, data_iterator, model, return_schedule_plan=True)[0] for _ in range(num_microbatches)
    ]
    engine = EPOverlapEngine.from_config(model, groups)
    return engine.step([(plan.tokens, plan.labels) for plan in plans])
