"""Applying command-line flags and Hydra-style ``key=value`` overrides to a recipe.

The EP-overlap flags go through upstream's helper name, ``_set_moe_a2a_overlap_overrides``, plus a separate
``_set_delay_wgrad_overrides``. Deliberate changes from upstream's helper (its gotchas):
    * ``--moe_a2a_overlap true`` turns on plain EP overlap only (upstream also turned on delayed wgrad);
      delayed wgrad has its own flag, ``--delay_wgrad_compute``.
    * ``--moe_a2a_overlap false`` really turns overlap off, and with it delayed wgrad (which needs overlap),
      even when the recipe enabled them (upstream left the recipe's values), unless ``--delay_wgrad_compute
      true`` asks for it explicitly (which then fails validation with a message saying why).
    * ``key=value`` overrides come last and win; ``false``/``none`` there mean what they say. Values are parsed
      by OmegaConf (as upstream Megatron-Bridge parses its overrides) and type-checked against the field.
"""

import dataclasses
import functools
import types
import typing
from typing import Any, Literal, Union

import yaml
from argument_parser import MODEL_INT_FLAGS, PIPELINE_FLAGS
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron.bridge.training.ep_overlap_config import EPOverlapCommOverlapConfig
from megatron.bridge.training.flex_dispatcher_backend import apply_flex_dispatcher_backend


def parse_value(text: str) -> Any:
    """A value as OmegaConf (YAML) reads it: ``true``/``false``, numbers, ``[1, 0]``, ``null``; ``none`` (any
    case) also means None, as in Bridge's overrides (where a field takes no None but the string, the string: see
    :func:`apply_overrides`); anything else is a string."""
    if text.strip().lower() == "none":
        return None
    return OmegaConf.to_container(OmegaConf.from_dotlist([f"value={text}"]))["value"]


def apply_overrides(recipe: Any, overrides: list[str]) -> list[str]:
    """Applies ``section.field=value`` strings (e.g. ``comm_overlap.delay_wgrad_compute=true``) in order.

    Every override is checked (form, field, and the value's type against the field's annotation); the good ones
    are applied. Returns one line per bad override, naming the field, the expected type and the value.
    """
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or "." not in key:
            problems.append(f"override {item!r}: not of the form section.field=value (e.g. model.num_layers=4)")
            continue
        *path, name = key.strip().split(".")
        target = recipe
        for part in path:
            if not dataclasses.is_dataclass(target) or not hasattr(target, part):
                problems.append(f"override {item!r}: {type(target).__name__} has no section {part!r}")
                break
            target = getattr(target, part)
        else:
            hints = _field_types(type(target))
            if name not in hints:
                problems.append(f"override {item!r}: {type(target).__name__} has no field {name!r}")
                continue
            try:
                value = parse_value(raw)
            except (OmegaConfBaseException, yaml.YAMLError) as exc:
                problems.append(
                    f"override {item!r}: cannot parse the value ({str(exc).splitlines()[0]}); a value that starts "
                    f"with YAML syntax (* & ! %) needs quotes: {key}='\"{raw}\"' in the shell"
                )
                continue
            if value is None and not _matches(None, hints[name]) and _matches(raw.strip(), hints[name]):
                value = raw.strip()  # "none" as a field's own word (cuda_graph_impl=none), where None is no value
            if not _matches(value, hints[name]):
                problems.append(f"override {key}={raw!r}: expected {_describe(hints[name])}, got {value!r}")
                continue
            setattr(target, name, value)
    return problems


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """Field name -> type annotation (resolved where possible, else the raw annotation)."""
    try:
        resolved = typing.get_type_hints(cls)
    except Exception:  # an annotation that names something not importable here: fall back per field
        resolved = {}
    return {f.name: resolved.get(f.name, f.type) for f in dataclasses.fields(cls)}


def _matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` fits the annotation ``hint`` (bool is not an int; an int is a float)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if hint is None or hint is type(None):
        return value is None
    if origin in (Union, types.UnionType):
        return any(_matches(value, arg) for arg in args)
    if origin is Literal:
        return value in args
    if origin in (list, tuple):
        if not isinstance(value, list):
            return False
        return not args or all(_matches(v, args[0]) for v in value)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return False  # a callable, a dtype, a forward reference: not settable from the command line


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (list, tuple):
        return f"a list of {_describe(args[0])}" if args else "a list"
    if hint is type(None):
        return "null"
    return getattr(hint, "__name__", str(hint))


def _set_moe_a2a_overlap_overrides(recipe: Any, moe_a2a_overlap: bool | None = False) -> Any:
    """EP all-to-all overlap on (plain overlap, shared-expert overlap off) or off (delayed wgrad off with it).

    None leaves the recipe as it is. Delayed wgrad is :func:`_set_delay_wgrad_overrides`, applied after this.
    """
    if moe_a2a_overlap is None:
        return recipe
    if recipe.comm_overlap is None:
        recipe.comm_overlap = EPOverlapCommOverlapConfig(tp_comm_overlap=recipe.model.tensor_model_parallel_size > 1)
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
    for name in ("hybrid_layer_pattern", "mtp_num_layers"):
        value = getattr(args, name)
        if value is not None:
            setattr(model, name, value)
    if args.recompute_modules is not None:
        model.recompute_granularity, model.recompute_modules = "selective", list(args.recompute_modules)
    if args.recompute_num_layers is not None and args.recompute_granularity is None and args.recompute_method is None:
        model.recompute_granularity, model.recompute_method = "full", "block"  # upstream harness's -rl alone
    for name in ("recompute_granularity", "recompute_method", "recompute_num_layers"):
        value = getattr(args, name, None)
        if value is not None:
            setattr(model, name, value)
    for name in (*MODEL_INT_FLAGS, *PIPELINE_FLAGS):
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
