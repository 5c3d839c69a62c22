"""A chunk's side of an engine step: the hooks the engine calls around it, and the backward scales of auxiliary
losses, set per step in Megatron-Core's two class attributes (the reference model reads this without the engine).

Contract:
    * :class:`StepHooks` declares the hooks the engine calls on every chunk, with no-op defaults:
      ``engine_problems()`` when the engine is built; ``start_step(loss)`` before a step with its :class:`StepLoss`;
      ``finish_step()`` after it, done or failed; ``sync_pipeline_copies(groups)`` with the data-parallel gradient
      sync; ``update_router_biases(groups)`` once per training step after it. The reference MoE GPT inherits it;
      a Megatron-Core plan gets ``engine.step_hooks.McoreStepHooks``.
    * An auxiliary loss (multi-token prediction; MoE load balancing and z-loss) is attached to an activation by
      Megatron-Core's ``MTPLossAutoScaler`` / ``MoEAuxLossAutoScaler``, whose backward hands it the gradient
      ``main_loss_backward_scale``: a class attribute, shared by every model in the process.
    * :func:`backward_scales` is the scale that gives, under the engine, the gradients Megatron-Core's driver and
      its DDP give. Its ``forward_step`` scales an auxiliary loss by ``1 / num_microbatches`` (the MoE one also by
      the context-parallel size), and DDP averages over the data-parallel ranks; with ``calculate_per_token_loss``
      the scale is 1 (the router multiplies its losses by its token count) and ``finalize_model_grads`` divides
      every gradient by the step's token count. The engine sums gradients over its data-parallel ranks and divides
      the main loss by the step's token count itself, so the same weights are ``1 / (units * dp)`` (times ``cp``
      for the MoE one), or ``1 / tokens``.
    * :class:`StepScales` sets both for one step and puts back the objects it found, so a result never depends on
      what another driver left in the process, and that driver still finds its own tensors afterwards. Both the
      reference MoE GPT and the engine's hooks on a Megatron-Core plan (``engine/step_hooks.py``) use it.
"""

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler


@dataclass(frozen=True)
class StepLoss:
    """How the engine normalizes one training step's loss, for a chunk whose auxiliary losses (multi-token
    prediction, MoE load balancing, z-loss) scale their own gradient: the main loss is the token-summed
    cross-entropy of ``units`` loss-carrying units divided by ``tokens``, and gradients are then summed (not
    averaged) over the engine's ``data_parallel`` ranks."""

    units: int  # microbatches that carry a loss (a chunked one's halves count two)
    data_parallel: int  # ranks the engine sums non-expert gradients over
    tokens: float  # tokens that count, over every microbatch of every rank


def backward_scales(loss: StepLoss, *, per_token: bool, context_parallel: int = 1) -> tuple[float, float]:
    """(MTP, MoE aux/z-loss) backward scales for a step normalized as ``loss`` says (see the module docstring)."""
    if per_token:
        return 1.0 / loss.tokens, 1.0 / loss.tokens
    mtp = 1.0 / (loss.units * loss.data_parallel)
    return mtp, context_parallel * mtp


class StepScales:
    """Megatron-Core's auxiliary-loss scales for one engine step: :meth:`set` at its start, :meth:`restore` at its
    end (done or failed)."""

    def __init__(self):
        self._found: tuple | None = None

    def set(self, mtp: float, moe: float, device: torch.device) -> None:
        if self._found is None:
            self._found = (MTPLossAutoScaler.main_loss_backward_scale, MoEAuxLossAutoScaler.main_loss_backward_scale)
        # New tensors of Megatron-Core's shape ([1]): another driver's tensor is never written into.
        MTPLossAutoScaler.main_loss_backward_scale = torch.tensor([mtp], dtype=torch.float32, device=device)
        MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor([moe], dtype=torch.float32, device=device)

    def restore(self) -> None:
        if self._found is not None:
            MTPLossAutoScaler.main_loss_backward_scale, MoEAuxLossAutoScaler.main_loss_backward_scale = self._found
            self._found = None


class StepHooks:
    """The engine's hooks on one chunk, each a no-op by default."""

    def engine_problems(self) -> list[str]:
        """What the chunk needs that only another driver gives (one line each, with its fix)."""
        return []

    def start_step(self, loss: StepLoss) -> None:
        """Before a step's first op: a chunk whose auxiliary losses scale their own backward sets it here."""

    def finish_step(self) -> None:
        """After the step (done or failed), last started first: puts back what :meth:`start_step` changed."""

    def sync_pipeline_copies(self, groups: Any) -> None:
        """After the data-parallel gradient sum: sums the gradients of a weight held on another pipeline stage."""

    def update_router_biases(self, groups: Any) -> None:
        """Once per training step after the gradient sync: aux-loss-free load balancing moves its biases."""
