"""The low-precision (fp8, fp4) contexts Megatron-Core's stacks give each layer, for the plan's node functions.

:func:`layer_context` is ``get_fp8_context``/``get_fp4_context`` for the layer's 0-based number (none with fp8
``delayed``, whose one :func:`step_context` wraps a whole step); looked up on Megatron-Core's modules at each call.
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
