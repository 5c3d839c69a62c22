"""Telling a value the user set on a config apart from a default: it differs from its default (the config's dataclass
default, a nested dataclass's, else Megatron-Core's model/DDP/optimizer config's) or was marked with
:func:`mark_explicit`. An attribute with no known default counts as set; a missing one does not."""

import dataclasses
import functools
from typing import Any

_MARKS = "_explicitly_set_fields"


def mark_explicit(config: Any, *names: str) -> None:
    """Records that ``names`` were set on purpose on ``config``: they count as set even where they equal a default."""
    marked = set(getattr(config, _MARKS, ())) | set(names)
    object.__setattr__(config, _MARKS, marked)


def _own_default(config: Any, name: str) -> tuple[bool, Any]:
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
    """True when ``config.name`` was set explicitly (see the module docstring)."""
    if not hasattr(config, name):
        return False
    if name in getattr(config, _MARKS, ()):
        return True
    known, default = _own_default(config, name)
    if not known:
        reference = _reference_defaults()
        known, default = name in reference, reference.get(name)
    return not known or getattr(config, name) != default
