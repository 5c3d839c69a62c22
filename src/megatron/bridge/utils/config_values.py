"""Telling a value the user set on a config apart from the config class's default."""

import dataclasses
from typing import Any


def is_explicitly_set(config: Any, name: str) -> bool:
    """True when ``config.name`` differs from its dataclass default.

    Objects that are not dataclasses, and fields without a default, have no known default: every present
    attribute counts as set, so it is never overwritten silently. A missing attribute is not set.
    """
    if not hasattr(config, name):
        return False
    if not dataclasses.is_dataclass(config):
        return True
    field = {f.name: f for f in dataclasses.fields(config)}.get(name)
    if field is None:
        return True
    if field.default is not dataclasses.MISSING:
        return getattr(config, name) != field.default
    if field.default_factory is not dataclasses.MISSING:
        return getattr(config, name) != field.default_factory()
    return True
