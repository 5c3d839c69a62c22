"""The low-precision (fp8, fp4) contexts Megatron-Core's stacks give each layer, for the plan's node functions.

Contract:
    * Per layer: fp8 with any recipe but ``delayed``, and fp4, run each layer of ``TransformerBlock`` and
      ``HybridStack`` inside ``get_fp8_context(config, n)`` / ``get_fp4_context(config, n)``, ``n`` the layer's
      global 0-based number. :func:`layer_context` returns that context; the plan enters it around every node
      function of the layer (forward and, being the same functions, full recompute's replay) and around every
      layer it runs whole. For a layer kept in bf16 (``first_last_layers_bf16``) Megatron-Core's own function
      returns a no-op, so the plan's does too.
    * Per step: fp8 ``delayed`` runs the whole stack inside one ``get_fp8_context(config)`` (its amax reduction
      runs when the outermost context exits, so it must not close per layer). :func:`step_context` returns it;
      Megatron-Core's combined 1F1B driver opens it around each ``run`` of a schedule plan, and the engine opens it
      around each step of the schedule program, so both wrap the same span of work.
    * The functions are looked up on Megatron-Core's modules at each call, as its stacks look them up, so a
      stand-in installed there (a test's spy) sees the plan's calls too. Without Transformer Engine both return a
      no-op context, as Megatron-Core's do.
    * Backward needs no context: Transformer Engine saves the recipe of each forward with its tensors, and delayed
      wgrad (``backward_dw``) computes from those.
"""

from contextlib import AbstractContextManager, nullcontext

import torch


def _recipe(config) -> str:
    recipe = getattr(config, "fp8_recipe", None)
    return str(getattr(recipe, "value", recipe))


def delayed_scaling(config) -> bool:
    """Whether ``config`` trains in fp8 with the delayed-scaling recipe (one context around the whole stack)."""
    return bool(getattr(config, "fp8", None)) and _recipe(config) == "delayed"


def layer_context(config, layer: torch.nn.Module) -> AbstractContextManager:
    """The context Megatron-Core's stacks open around ``layer``'s forward (see the module docstring)."""
    number = layer.layer_number - 1  # Megatron-Core counts layers from 1
    if getattr(config, "fp8", None):
        if delayed_scaling(config):
            return nullcontext()
        from megatron.core import fp8_utils

        return fp8_utils.get_fp8_context(config, number)
    if getattr(config, "fp4", None):
        from megatron.core import fp4_utils

        return fp4_utils.get_fp4_context(config, number)
    return nullcontext()


def step_context(config) -> AbstractContextManager:
    """The context around a whole step of the stack: fp8 delayed scaling's one context, else a no-op."""
    if not delayed_scaling(config):
        return nullcontext()
    from megatron.core import fp8_utils

    return fp8_utils.get_fp8_context(config)
