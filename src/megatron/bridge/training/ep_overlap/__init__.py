"""EP overlap: a rank's training step as one schedule program: ``program/`` (the schedule as data), ``runtime/``
(its nodes and lanes, what executes it) and ``mcore/`` (Megatron-Core models, and the hook that runs the program's
steps inside Megatron-Core's driver). What each file holds: the README's Layout table. The project's lab
(``ep_overlap_lab``: the CPU reference engine and model, the planner, the rank launcher) is outside this package.

Names are loaded on first use, so importing the planner or the program loads no torch.
"""

import importlib

_NAMES = {
    "IGNORE_INDEX": "contract",
    "layer_step": "program.steps",
    "program": "program.steps",
    "EPOverlapOptions": "options",
    "StepRecorder": "runtime.records",
    "StepStats": "runtime.records",
}
__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    globals()[name] = value
    return value
