"""EP-overlap engine: the paired 1F1B MoE layer schedule, its nodes, lanes and step records.

Start at ``schedule.py``: ``layer_step`` is the paired layer step, ``EPOverlapEngine`` the PP=1 driver.
"""

from megatron.bridge.training.ep_overlap.pipeline import Action, schedule_actions
from megatron.bridge.training.ep_overlap.records import StepRecorder, StepStats
from megatron.bridge.training.ep_overlap.schedule import IGNORE_INDEX, EPOverlapEngine, StepResult, layer_step

__all__ = [
    "IGNORE_INDEX",
    "Action",
    "EPOverlapEngine",
    "schedule_actions",
    "StepRecorder",
    "StepResult",
    "StepStats",
    "layer_step",
]
