"""EP overlap: a rank's training step as one schedule program: ``program/`` (the schedule as data), ``runtime/`` (the
nodes and lanes that execute it), ``mcore/`` (Megatron-Core models and the driver hook); the lab (``ep_overlap_lab``)
is outside. Names load on first use, so importing the program loads no torch."""

import importlib

_NAMES = {
    "IGNORE_INDEX": "contract",
    "layer_step": "program.steps",
    "program": "program.steps",
    "EPOverlapOptions": "options",
    "StepRecorder": "runtime.records",
}
__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    globals()[name] = value
    return value
