"""Test-only: stands in for Megatron-Core's ``get_fp8_context`` and ``get_fp4_context`` (which need Transformer Engine)
and records, for every forward of every module that holds weights, which of their contexts are open around it.

:func:`install` replaces both functions everywhere Megatron-Core looks them up (its stacks import them by name; its
layers, the plan and the driver read them from ``fp8_utils``/``fp4_utils``). A stand-in decides as Megatron-Core's
own does: a no-op without fp8/fp4 and for a layer kept in bf16 (``first_last_layers_bf16``), else a context named
after the recipe and the layer it was opened for (``fp8:mxfp8@1``, ``fp8:delayed@all`` for the whole stack).

:func:`watch` hooks a model: every module with parameters of its own records ``(open contexts, is_first_microbatch)``
per forward, the flag emulating Transformer Engine's (a module casts its weights afresh when set, then clears it), and
every ``backward_dw`` records the contexts open around it and what it was asked for.
"""

import contextlib
from collections import Counter, defaultdict

OPEN: list[str] = []  # the spy contexts open now, outermost first


class _Spy(contextlib.AbstractContextManager):
    def __init__(self, label: str):
        self.label = label

    def __enter__(self):
        OPEN.append(self.label)
        return self

    def __exit__(self, *exc):
        assert OPEN.pop() == self.label, "spy contexts closed out of order"
        return False


def _bf16_layer(config, layer_no: int) -> bool:
    from megatron.core.fp8_utils import is_first_last_bf16_layer

    return is_first_last_bf16_layer(config, layer_no)


def _label(kind: str, recipe, layer_no: int) -> str:
    return f"{kind}:{getattr(recipe, 'value', recipe)}@{'all' if layer_no < 0 else layer_no}"


def fp8_context(config, layer_no: int = -1, is_init: bool = False):
    if is_init or not config.fp8 or _bf16_layer(config, layer_no):
        return contextlib.nullcontext()
    return _Spy(_label("fp8", config.fp8_recipe, layer_no))


def fp4_context(config, layer_no: int = -1, is_init: bool = False):
    if is_init or not config.fp4 or (layer_no >= 0 and _bf16_layer(config, layer_no)):
        return contextlib.nullcontext()
    return _Spy(_label("fp4", config.fp4_recipe, layer_no))


def install() -> None:
    import megatron.core.fp4_utils as fp4_utils
    import megatron.core.fp8_utils as fp8_utils
    import megatron.core.models.hybrid.hybrid_block as hybrid_block
    import megatron.core.pipeline_parallel.combined_1f1b as combined_1f1b
    import megatron.core.recompute as recompute
    import megatron.core.transformer.multi_token_prediction as mtp
    import megatron.core.transformer.transformer_block as transformer_block

    for module in (fp8_utils, transformer_block, hybrid_block, combined_1f1b, mtp, recompute):
        module.get_fp8_context = fp8_context
    for module in (fp4_utils, transformer_block, hybrid_block, recompute):
        module.get_fp4_context = fp4_context


class Watch:
    """What :func:`watch` recorded of one model (or a rank's chunks, ``prefix``-ed by chunk)."""

    def __init__(self):
        self.forwards: dict[str, Counter] = defaultdict(Counter)  # module -> Counter((contexts, first microbatch))
        self.wgrads: dict[str, Counter] = defaultdict(Counter)  # module -> Counter((contexts, arguments))

    def attach(self, model, prefix: str = "") -> None:
        for name, module in model.named_modules():
            if any(p is not None for p in module._parameters.values()):
                module.is_first_microbatch = False  # what Transformer Engine's modules carry
                module.register_forward_pre_hook(self._forward_hook(prefix + name))
            if callable(getattr(module, "backward_dw", None)) and name:
                module.backward_dw = self._wgrad_hook(prefix + name, module.backward_dw)

    def _forward_hook(self, name: str):
        def record(module, args):
            self.forwards[name][(tuple(OPEN), module.is_first_microbatch)] += 1
            module.is_first_microbatch = False  # cast once, then reuse (TE's weight cache)

        return record

    def _wgrad_hook(self, name: str, backward_dw):
        def record(*args, **kwargs):
            self.wgrads[name][(tuple(OPEN), tuple(sorted(kwargs.items())))] += 1
            return backward_dw(*args, **kwargs)

        return record

    def under(self, part: str) -> dict[str, Counter]:
        """The forwards of the modules whose name contains ``part`` (e.g. ``decoder.layers``)."""
        return {name: calls for name, calls in self.forwards.items() if part in name}
