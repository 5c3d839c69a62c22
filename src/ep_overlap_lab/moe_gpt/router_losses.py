"""The reference router's auxiliary losses, computed as Megatron-Core's ``TopKRouter`` computes them.

Contract:
    * ``moe_z_loss_coeff`` (not None): the z-loss, ``coeff * mean_t(logsumexp(logits_t)^2)``, attached to the router
      logits before routing reads them.
    * ``moe_router_load_balancing_type`` ``aux_loss`` with ``moe_aux_loss_coeff`` above 0: the Switch load-balancing
      loss over the microbatch, ``coeff * E / (K * T^2) * sum_e(P_e * f_e)``, where ``P_e`` sums expert e's scores
      (softmax over all experts, or sigmoid normalized over them) and ``f_e`` counts the tokens whose top-k of those
      scores holds e. ``seq_aux_loss``: the same per sequence, averaged over the microbatch's sequences. Attached to
      the routing probabilities. ``global_aux_loss`` (counts kept over the step and the data-parallel ranks) and a
      list of types are refused by ``config.model_feature_problems``.
    * Both only in a training forward with gradients, and each through Megatron-Core's ``MoEAuxLossAutoScaler``:
      its backward gives the loss the gradient ``main_loss_backward_scale``, which the model sets per engine step
      (``ep_overlap_lab/step_loss.py``). With ``calculate_per_token_loss`` each loss is first multiplied by
      the microbatch's token count, as the router does (the scale is then ``1 / tokens``).
    * Megatron-Core's own functions compute the values (``compute_routing_scores_for_aux_loss``,
      ``switch_load_balancing_loss_func``, ``z_loss_func``), unfused; one rank's tokens are the whole reduction
      (no tensor or context parallelism in the reference model).
"""

from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    compute_routing_scores_for_aux_loss,
    switch_load_balancing_loss_func,
    z_loss_func,
)

LOAD_BALANCING = ("aux_loss", "seq_aux_loss")  # the load-balancing losses the reference router computes


@dataclass(frozen=True)
class RouterLosses:
    """What a layer's router adds to the loss; ``of(config)`` is None when it adds nothing."""

    load_balancing: str | None  # one of LOAD_BALANCING, or None
    aux_coeff: float
    z_coeff: float | None
    per_token: bool
    topk: int
    experts: int
    score_function: str
    seq_length: int

    @classmethod
    def of(cls, config) -> "RouterLosses | None":
        kind = config.moe_router_load_balancing_type
        balancing = kind if kind in LOAD_BALANCING and (config.moe_aux_loss_coeff or 0.0) > 0 else None
        if balancing is None and config.moe_z_loss_coeff is None:
            return None
        return cls(
            load_balancing=balancing,
            aux_coeff=float(config.moe_aux_loss_coeff or 0.0),
            z_coeff=config.moe_z_loss_coeff,
            per_token=bool(config.calculate_per_token_loss),
            topk=config.moe_router_topk,
            experts=config.num_moe_experts,
            score_function=config.moe_router_score_function,
            seq_length=config.seq_length,
        )

    def _attach(self, activation: torch.Tensor, loss: torch.Tensor, tokens: int) -> torch.Tensor:
        return MoEAuxLossAutoScaler.apply(activation, loss * tokens if self.per_token else loss)

    def with_z_loss(self, logits_TE: torch.Tensor) -> torch.Tensor:
        """``logits_TE`` carrying the z-loss (unchanged without one)."""
        if self.z_coeff is None:
            return logits_TE
        return self._attach(logits_TE, z_loss_func(logits_TE, self.z_coeff), logits_TE.shape[0])

    def with_load_balancing(self, probs_TK: torch.Tensor, logits_TE: torch.Tensor) -> torch.Tensor:
        """``probs_TK`` carrying the load-balancing loss of the router logits ``logits_TE`` (unchanged without one)."""
        if self.load_balancing is None:
            return probs_TK
        T, E, K = logits_TE.shape[0], self.experts, self.topk
        chosen_TE, scores_TE = compute_routing_scores_for_aux_loss(logits_TE, K, self.score_function)
        if self.load_balancing == "aux_loss":
            loss = switch_load_balancing_loss_func(scores_TE, chosen_TE.sum(dim=0), T, K, E, self.aux_coeff)
        else:  # per sequence: each (sequence, expert) pair counts as an expert of its own, as Megatron-Core folds it
            S = self.seq_length
            B = T // S
            scores_SX = scores_TE.view(B, S, E).transpose(0, 1).reshape(S, B * E)
            chosen_SX = chosen_TE.view(B, S, E).transpose(0, 1).reshape(S, B * E)
            loss = switch_load_balancing_loss_func(scores_SX, chosen_SX.sum(dim=0), S, K, E, self.aux_coeff) / B
        return self._attach(probs_TK, loss, T)
