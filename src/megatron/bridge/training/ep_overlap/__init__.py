"""EP overlap: a rank's training step as one schedule program, run three ways.

    program/    the schedule as data: which units each step runs, and its windows of ops (no torch)
    engine/     executes the program with torch: nodes, comm lanes, P2P, records, the plain path
    planner/    prices the program before a run (no torch)
    mcore/      Megatron-Core models, and the hook that runs the program's steps inside Megatron-Core's driver
    options.py  the schedule's options; contract.py what a model implements; placement.py the engine users
                build (``EPOverlapEngine``)

Beside it, for Megatron-Bridge: ``training/ep_overlap_config.py`` (the recipe's config) and
``training/ep_overlap_step.py`` (Bridge-style ``forward_step``/``train_step``).

Names are loaded on first use, so importing the planner or the program loads no torch.
"""

import importlib

_NAMES = {
    "IGNORE_INDEX": "contract",
    "Action": "program.pipeline",
    "schedule_actions": "program.pipeline",
    "layer_step": "program.steps",
    "program": "program.steps",
    "EPOverlapOptions": "options",
    "EPOverlapEngine": "placement",
    "StepResult": "engine",
    "StepRecorder": "engine",
    "StepStats": "engine",
}
__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    globals()[name] = value
    return value
