"""Telling a value the user set on a config apart from a default.

A value counts as explicitly set on a config on either of two signals, and on no other:
    1. It differs from the field's default. The default is the config's own dataclass field default; for a
       dataclass that only forwards the field to a nested dataclass (Megatron's ``GPTModelConfig`` forwards every
       ``TransformerConfig`` field to its ``.transformer``), the nested config's; and for a config that holds the
       attribute without declaring it as a field (a recipe's provider stand-in, a non-dataclass object), the default
       of the same field on Megatron-Core's own config class for it (``TransformerConfig``,
       ``DistributedDataParallelConfig`` or ``OptimizerConfig``, the first that declares it).
    2. It was recorded as set with :func:`mark_explicit` (a launcher that applies a user's override, or a recipe
       that states a value on purpose even where it equals the default).
An attribute with no known default anywhere counts as set, so it is never overwritten silently; a missing
attribute is not set.
"""

import dataclasses
import functools
from typing import Any

_MARKS = "_explicitly_set_fields"  # where mark_explicit records names, on the config object itself


def mark_explicit(config: Any, *names: str) -> None:
    """Records that ``names`` were set on purpose on ``config``: they count as set even where they equal a default."""
    marked = set(getattr(config, _MARKS, ())) | set(names)
    object.__setattr__(config, _MARKS, marked)


def _own_default(config: Any, name: str) -> tuple[bool, Any]:
    """(whether ``config``'s dataclass declares a default for ``name``, that default)."""
    if not dataclasses.is_dataclass(config):
        return False, None
    own = {f.name: f for f in dataclasses.fields(config)}
    field = own.get(name)
    if field is None:
        for candidate in own.values():
            nested = getattr(config, candidate.name, None)
            if dataclasses.is_dataclass(nested) and not isinstance(nested, type):
                if any(f.name == name for f in dataclasses.fields(nested)):
                    return _own_default(nested, name)
        return False, None
    if field.default is not dataclasses.MISSING:
        return True, field.default
    if field.default_factory is not dataclasses.MISSING:
        return True, field.default_factory()
    return False, None


@functools.cache
def _reference_defaults() -> dict[str, Any]:
    """Field defaults of Megatron-Core's model, DDP and optimizer configs (the first class to declare a name wins)."""
    try:
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError:
        return {}
    defaults: dict[str, Any] = {}
    for cls in (TransformerConfig, DistributedDataParallelConfig, OptimizerConfig):
        for field in dataclasses.fields(cls):
            if field.default is not dataclasses.MISSING:
                defaults.setdefault(field.name, field.default)
    return defaults


def is_explicitly_set(config: Any, name: str) -> bool:
    """True when ``config.name`` was set explicitly (see the module docstring for the two signals)."""
    if not hasattr(config, name):
        return False
    if name in getattr(config, _MARKS, ()):
        return True
    known, default = _own_default(config, name)
    if not known:
        reference = _reference_defaults()
        known, default = name in reference, reference.get(name)
    return not known or getattr(config, name) != default
