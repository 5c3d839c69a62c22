"""The backward scales of auxiliary losses under the engine, set per step in Megatron-Core's two class attributes.

Contract:
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
      reference MoE GPT and the Megatron-Core plans use it.
"""

import torch
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

from megatron.bridge.training.ep_overlap.contract import StepLoss


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
