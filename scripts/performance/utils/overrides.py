"""Applying command-line flags and Hydra-style ``key=value`` overrides to a recipe.

The EP-overlap flags go through upstream's helper name, ``_set_moe_a2a_overlap_overrides``, plus a separate
``_set_delay_wgrad_overrides``. Deliberate changes from upstream's helper (its gotchas):
    * ``--moe_a2a_overlap true`` turns on plain EP overlap only (upstream also turned on delayed wgrad);
      delayed wgrad has its own flag, ``--delay_wgrad_compute``.
    * ``--moe_a2a_overlap false`` really turns overlap off, and with it delayed wgrad (which needs overlap),
      even when the recipe enabled them (upstream left the recipe's values), unless ``--delay_wgrad_compute
      true`` asks for it explicitly (which then fails validation with a message saying why).
    * ``key=value`` overrides come last; ``false``/``none`` there mean what they say. Values are parsed by
      OmegaConf (as upstream Megatron-Bridge parses its overrides) and type-checked against the field. An override
      of a field a flag sets (in any spelling that reaches that field, :func:`same_field`) must agree with the flag:
      one that does not is refused, not applied over it (:func:`apply_flag_overrides` says which flag set what).
"""

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, Union

import yaml
from argument_parser import MODEL_INT_FLAGS, PIPELINE_FLAGS
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron.bridge.training.comm_overlap_values import MODEL_RESOLVED_FIELDS
from megatron.bridge.training.ep_overlap_config import EPOverlapCommOverlapConfig
from megatron.bridge.training.flex_dispatcher_backend import apply_flex_dispatcher_backend


def parse_value(text: str) -> Any:
    """A value as OmegaConf (YAML) reads it: ``true``/``false``, numbers, ``[1, 0]``, ``null``; ``none`` (any
    case) also means None, as in Bridge's overrides (where a field takes no None but the string, the string: see
    :func:`apply_overrides`); anything else is a string."""
    if text.strip().lower() == "none":
        return None
    return OmegaConf.to_container(OmegaConf.from_dotlist([f"value={text}"]))["value"]


def apply_overrides(
    recipe: Any, overrides: list[str], flags: Mapping[str, tuple[str, Any]] | None = None
) -> list[str]:
    """Applies ``section.field=value`` strings (e.g. ``comm_overlap.delay_wgrad_compute=true``) in order.

    Every override is checked (form, field, the value's type against the field's annotation, and agreement with
    the flag that set the same field, where ``flags`` says one did); the good ones are applied.

    Args:
        recipe: The recipe to change in place.
        overrides: The ``section.field=value`` strings.
        flags: What the flags set, as :func:`apply_flag_overrides` returns it (``"section.field"`` -> (flag,
            value)); None checks no override against a flag.

    Returns:
        One line per bad override, naming the field, the value and what to do.
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
            clash = _flag_clash(key.strip(), raw, value, flags or {})
            if clash:
                problems.append(clash)
                continue
            setattr(target, name, value)
    return problems


def same_field(key: str) -> tuple[str, ...]:
    """Every override key that reaches the config field ``key`` (``"section.field"``), ``key`` first.

    A field that comm_overlap resolves onto the model config (``MODEL_RESOLVED_FIELDS``) has two: the harness lifts
    ``model.overlap_moe_expert_parallel_comm`` and ``model.delay_wgrad_compute`` to comm_overlap
    (``checks.lift_model_overlap_flags``), and ``CommOverlapConfig.setup`` writes comm_overlap's value to the model.
    """
    section, _, name = key.partition(".")
    if section in ("model", "comm_overlap") and name in MODEL_RESOLVED_FIELDS:
        other = "comm_overlap" if section == "model" else "model"
        return (key, f"{other}.{name}")
    return (key,)


def _flag_clash(key: str, raw: str, value: Any, flags: Mapping[str, tuple[str, Any]]) -> str | None:
    """The problem with overriding ``key`` to ``value`` where a flag set that field to another value, else None."""
    for spelling in same_field(key):
        if spelling in flags and flags[spelling][1] != value:
            flag, wanted = flags[spelling]
            same = "" if spelling == key else ", the same field"
            return (
                f"override {key}={raw!r}: {flag} sets {spelling}={wanted!r}{same}; give the field one value: drop "
                "the override or the flag"
            )
    return None


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


def _model_field(name: str) -> Callable[[Any, Any], None]:
    """The setter of a flag named as the model field it sets."""

    def set_field(recipe: Any, args: Any) -> None:
        setattr(recipe.model, name, getattr(args, name))

    return set_field


def _train_field(name: str) -> Callable[[Any, Any], None]:
    """The setter of a flag named as the training field it sets."""

    def set_field(recipe: Any, args: Any) -> None:
        setattr(recipe.train, name, getattr(args, name))

    return set_field


def _set_ab(recipe: Any, args: Any) -> None:
    # The overlap arm is the recipe with overlap on (utils/harness_config.arms_of); the baseline turns it off itself.
    if args.ab:
        recipe.comm_overlap.overlap_moe_expert_parallel_comm = True


def _set_precision(recipe: Any, args: Any) -> None:
    recipe.model.bf16 = args.precision == "bf16"
    recipe.model.fp16 = False


def _set_recompute_modules(recipe: Any, args: Any) -> None:
    recipe.model.recompute_granularity, recipe.model.recompute_modules = "selective", list(args.recompute_modules)


def _set_recompute_num_layers(recipe: Any, args: Any) -> None:
    if args.recompute_granularity is None and args.recompute_method is None:
        recipe.model.recompute_granularity, recipe.model.recompute_method = "full", "block"  # upstream harness's -rl
    recipe.model.recompute_num_layers = args.recompute_num_layers


def _set_router_topk(recipe: Any, args: Any) -> None:
    recipe.model.moe_router_topk = args.moe_router_topk
    recipe.model.moe_router_pre_softmax = args.moe_router_topk == 1


TRAIN_FLAGS = ("max_steps", "micro_batch_size", "num_microbatches", "seed")

# Every flag that sets recipe fields, in the order they apply (a later one wins a field both set: an explicit
# --delay_wgrad_compute after --moe_a2a_overlap), with its setter, called when the flag is given (not None). This is
# the one table of what the flags set: apply_flag_overrides records which fields each setter writes.
FLAG_SETTERS: dict[str, Callable[[Any, Any], None]] = {
    "ab": _set_ab,
    "moe_a2a_overlap": lambda recipe, args: _set_moe_a2a_overlap_overrides(recipe, args.moe_a2a_overlap),
    "delay_wgrad_compute": lambda recipe, args: _set_delay_wgrad_overrides(recipe, args.delay_wgrad_compute),
    "cuda_graph_impl": _model_field("cuda_graph_impl"),
    "precision": _set_precision,
    "hybrid_layer_pattern": _model_field("hybrid_layer_pattern"),
    "mtp_num_layers": _model_field("mtp_num_layers"),
    "recompute_modules": _set_recompute_modules,
    "recompute_granularity": _model_field("recompute_granularity"),
    "recompute_method": _model_field("recompute_method"),
    "recompute_num_layers": _set_recompute_num_layers,
    **{name: _model_field(name) for name in (*MODEL_INT_FLAGS, *PIPELINE_FLAGS) if name != "moe_router_topk"},
    "moe_router_topk": _set_router_topk,
    **{name: _train_field(name) for name in TRAIN_FLAGS},
    "moe_flex_dispatcher_backend": lambda recipe, args: apply_flex_dispatcher_backend(
        recipe.model, args.moe_flex_dispatcher_backend
    ),
}


class _Recorded:
    """A recipe (or one of its sections) as a flag's setter sees it: every field the setter writes goes through to
    the recipe and is recorded as ``"section.field"``, so what a flag sets is read from its code, not listed twice."""

    def __init__(self, target: Any, record: dict[str, Any], section: str = "") -> None:
        vars(self).update(_target=target, _record=record, _section=section)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if not self._section and dataclasses.is_dataclass(value):
            return _Recorded(value, self._record, name)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target, name, value)
        if self._section:
            self._record[f"{self._section}.{name}"] = value


def apply_flag_overrides(recipe: Any, args: Any) -> dict[str, tuple[str, Any]]:
    """Applies the named command-line flags that map onto recipe fields (None leaves the recipe's value).

    Args:
        recipe: The recipe to change in place.
        args: The parsed command line (``argument_parser.parse_cli_args``).

    Returns:
        What the flags set: ``"section.field"`` -> (the flag as given, e.g. ``--num_layers=4``, the field's value),
        the last flag that wrote a field winning, as in the recipe.
    """
    set_by: dict[str, tuple[str, Any]] = {}
    for flag, setter in FLAG_SETTERS.items():
        given = getattr(args, flag, None)
        if given is None:
            continue
        written: dict[str, Any] = {}
        setter(_Recorded(recipe, written), args)
        set_by.update({field: (f"--{flag}={given!r}", value) for field, value in written.items()})
    return set_by
