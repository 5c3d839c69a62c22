"""Selective recompute in the reference MoE GPT, chosen as Megatron-Core chooses it.

Contract:
    * ``recompute_granularity="selective"`` with ``recompute_modules`` (Megatron-Core's field) picks what each
      layer recomputes in backward instead of keeping: ``layernorm`` (the attention and MLP norms), ``core_attn``
      (scaled dot-product attention), ``moe_act`` (the experts' activation), ``mlp`` (a dense layer's MLP), ``moe``
      (a MoE layer's experts: sort, grouped GEMMs, activation, unsort). Anything else, full recompute and layer
      recompute (``recompute_method``, ``recompute_num_layers``) are refused by ``config.model_feature_problems``.
    * A recomputed part keeps only its inputs, saved as its own (so ``engine/saved.py`` counts them); its backward
      runs its forward again, then its backward. Inside the overlapped schedule that happens in the node's backward,
      in the window the program gives that node, beside the other microbatch's all-to-all.
    * Numerics: the same ops on the same inputs, so losses and gradients are bitwise equal to keeping everything
      (CPU; on GPU, as far as the kernels are deterministic).
"""

import torch
import torch.utils.checkpoint

RECOMPUTABLE = ("layernorm", "core_attn", "moe_act", "mlp", "moe")


def recompute_modules(config) -> frozenset[str]:
    """What ``config`` asks the reference model to recompute (nothing unless the granularity is selective)."""
    if config.recompute_granularity != "selective":
        return frozenset()
    return frozenset(config.recompute_modules or ())


def run(recompute: bool, fn, *inputs: torch.Tensor) -> torch.Tensor:
    """``fn(*inputs)``; with ``recompute``, keeping only ``inputs`` for backward, which runs ``fn`` again.

    Reentrant checkpointing saves the inputs with ``save_for_backward``, where saved-tensor hooks (the activation
    count) see them, and runs the first forward without building a graph.
    """
    if not (recompute and torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
        return fn(*inputs)
    return torch.utils.checkpoint.checkpoint(fn, *inputs, use_reentrant=True, preserve_rng_state=False)
