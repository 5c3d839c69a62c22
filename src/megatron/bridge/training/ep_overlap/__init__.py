"""EP overlap: a training step's work as a schedule program's steps (``program/``), run by ``runtime/``; ``mcore/``
adapts Megatron-Core. Names load on first use, so importing the options loads no torch."""

import importlib

_NAMES = {
    "IGNORE_INDEX": "contract",
    "EPOverlapOptions": "options",
}
__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    globals()[name] = value
    return value
