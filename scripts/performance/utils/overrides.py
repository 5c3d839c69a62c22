"""Applying command-line flags and Hydra-style ``key=value`` overrides to a recipe.

Fixes of upstream gotchas:
    * ``--moe_a2a_overlap true`` turns on plain EP overlap only; delayed wgrad has its own flag,
      ``--delay_wgrad_compute``.
    * ``--moe_a2a_overlap false`` really turns overlap off, and with it delayed wgrad (which needs overlap),
      even when the recipe enabled them, unless ``--delay_wgrad_compute true`` asks for it explicitly (which
      then fails validation with a message saying why).
    * ``key=value`` overrides come last and win; ``false``/``none`` there mean what they say.
"""

import ast
import dataclasses
from typing import Any

from argument_parser import MODEL_INT_FLAGS

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


def apply_flag_overrides(recipe: Any, args: Any) -> None:
    """Applies the named command-line flags that map onto recipe fields (None leaves the recipe's value)."""
    model, overlap, train = recipe.model, recipe.comm_overlap, recipe.train
    if args.moe_a2a_overlap is not None:
        overlap.overlap_moe_expert_parallel_comm = args.moe_a2a_overlap
        if args.moe_a2a_overlap:
            model.moe_shared_expert_overlap = False
        elif args.delay_wgrad_compute is None:
            overlap.delay_wgrad_compute = False  # delayed wgrad needs overlap; off means off
    if args.delay_wgrad_compute is not None:
        overlap.delay_wgrad_compute = args.delay_wgrad_compute
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
