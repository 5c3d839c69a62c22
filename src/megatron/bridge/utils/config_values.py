"""Telling a value the user set on a config apart from the config class's default."""

import dataclasses
from typing import Any


def is_explicitly_set(config: Any, name: str) -> bool:
    """True when ``config.name`` differs from its dataclass default.

    A dataclass that only forwards ``name`` to a nested dataclass (Megatron's ``GPTModelConfig`` proxies every
    ``TransformerConfig`` field to its ``transformer``) is judged by that nested config's default. Objects that
    are not dataclasses, and fields without a default, have no known default: every present attribute counts as
    set, so it is never overwritten silently. A missing attribute is not set.
    """
    if not hasattr(config, name):
        return False
    if not dataclasses.is_dataclass(config):
        return True
    own = {f.name: f for f in dataclasses.fields(config)}
    field = own.get(name)
    if field is None:
        for candidate in own.values():
            nested = getattr(config, candidate.name, None)
            if (
                dataclasses.is_dataclass(nested)
                and not isinstance(nested, type)
                and any(f.name == name for f in dataclasses.fields(nested))
            ):
                return is_explicitly_set(nested, name)
        return True
    if field.default is not dataclasses.MISSING:
        return getattr(config, name) != field.default
    if field.default_factory is not dataclasses.MISSING:
        return getattr(config, name) != field.default_factory()
    return True
