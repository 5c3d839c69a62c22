"""Applying command-line flags and Hydra-style ``key=value`` overrides to a recipe.

The EP-overlap flags go through upstream's helper name, ``_set_moe_a2a_overlap_overrides``, plus a separate
``_set_delay_wgrad_overrides``. Deliberate changes from upstream's helper (its gotchas):
    * ``--moe_a2a_overlap true`` turns on plain EP overlap only (upstream also turned on delayed wgrad);
      delayed wgrad has its own flag, ``--delay_wgrad_compute``.
    * ``--moe_a2a_overlap false`` really turns overlap off, and with it delayed wgrad (which needs overlap),
      even when the recipe enabled them (upstream left the recipe's values), unless ``--delay_wgrad_compute
      true`` asks for it explicitly (which then fails validation with a message saying why).
    * ``key=value`` overrides come last and win; ``false``/``none`` there mean what they say.
"""

import ast
import dataclasses
from typing import Any

from argument_parser import MODEL_INT_FLAGS

from megatron.bridge.training.comm_overlap import CommOverlapConfig
from megatron.bridge.training.flex_dispatcher_backend import apply_flex_dispatcher_backend

_WORDS = {"true": True, "false": False, "none": None, "null": None}


class OverrideError(ValueError):
    """An override names an unknown field or has a malformed form."""


def parse_value(text: str) -> Any:
    """``true``/``false``/``none``/``null`` (any case), Python literals (numbers, lists), else the string."""
    lowered = text.strip().lower()
    if lowered in _WORDS:
        return _WORDS[lowered]
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def apply_overrides(recipe: Any, overrides: list[str]) -> None:
    """Applies ``section.field=value`` strings (e.g. ``comm_overlap.delay_wgrad_compute=true``) in order."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or "." not in key:
            raise OverrideError(f"override {item!r} is not of the form section.field=value (e.g. model.num_layers=4)")
        *path, name = key.strip().split(".")
        target = recipe
        for part in path:
            if not hasattr(target, part):
                raise OverrideError(f"override {item!r}: {type(target).__name__} has no section {part!r}")
            target = getattr(target, part)
        known = {f.name for f in dataclasses.fields(target)} if dataclasses.is_dataclass(target) else set(vars(target))
        if name not in known:
            raise OverrideError(f"override {item!r}: {type(target).__name__} has no field {name!r}")
        setattr(target, name, parse_value(raw))


def _set_moe_a2a_overlap_overrides(recipe: Any, moe_a2a_overlap: bool | None = False) -> Any:
    """EP all-to-all overlap on (plain overlap, shared-expert overlap off) or off (delayed wgrad off with it).

    None leaves the recipe as it is. Delayed wgrad is :func:`_set_delay_wgrad_overrides`, applied after this.
    """
    if moe_a2a_overlap is None:
        return recipe
    if recipe.comm_overlap is None:
        recipe.comm_overlap = CommOverlapConfig(tp_comm_overlap=recipe.model.tensor_model_parallel_size > 1)
    recipe.comm_overlap.overlap_moe_expert_parallel_comm = moe_a2a_overlap
    if moe_a2a_overlap:
        recipe.model.moe_shared_expert_overlap = False
    else:
        recipe.comm_overlap.delay_wgrad_compute = False  # delayed wgrad needs overlap; off means off
    return recipe


def _set_delay_wgrad_overrides(recipe: Any, delay_wgrad_compute: bool | None = None) -> Any:
    """Delayed expert wgrad on or off, as asked; None leaves the recipe (and the a2a flag's choice) as it is."""
    if delay_wgrad_compute is not None:
        recipe.comm_overlap.delay_wgrad_compute = delay_wgrad_compute
    return recipe


def apply_flag_overrides(recipe: Any, args: Any) -> None:
    """Applies the named command-line flags that map onto recipe fields (None leaves the recipe's value)."""
    _set_moe_a2a_overlap_overrides(recipe, args.moe_a2a_overlap)
    _set_delay_wgrad_overrides(recipe, args.delay_wgrad_compute)
    model, train = recipe.model, recipe.train
    if args.cuda_graph_impl is not None:
        model.cuda_graph_impl = args.cuda_graph_impl
    if args.precision is not None:
        model.bf16 = args.precision == "bf16"
        model.fp16 = False
    for name in MODEL_INT_FLAGS:
        value = getattr(args, name)
        if value is not None:
            setattr(model, name, value)
    if args.moe_router_topk is not None:
        model.moe_router_pre_softmax = args.moe_router_topk == 1
    for name in ("max_steps", "micro_batch_size", "num_microbatches", "seed"):
        value = getattr(args, name)
        if value is not None:
            setattr(train, name, value)
    if args.moe_flex_dispatcher_backend is not None:
        apply_flex_dispatcher_backend(model, args.moe_flex_dispatcher_backend)
