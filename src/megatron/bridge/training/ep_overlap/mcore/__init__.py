"""Megatron-Core models under the EP-overlap schedule.

``gpt.py``: node functions for Megatron-Core's ``TransformerLayer`` and :class:`McoreGPTPlan`, a ``GPTModel`` (or
one pipeline chunk of it) as the engine runs it. ``hook.py``: :func:`use_ep_overlap_schedule`, the Megatron-Bridge
pre-wrap hook that makes Megatron-Core's own combined 1F1B driver run the schedule program's steps.
"""

from megatron.bridge.training.ep_overlap.mcore.gpt import McoreGPTPlan, McoreLayer, McoreRouting, mcore_ep_groups
from megatron.bridge.training.ep_overlap.mcore.hook import (
    DEFAULT_TIMEOUT,
    EPOverlapPlanBuilder,
    EPOverlapSchedulePlan,
    use_ep_overlap_schedule,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "EPOverlapPlanBuilder",
    "EPOverlapSchedulePlan",
    "McoreGPTPlan",
    "McoreLayer",
    "McoreRouting",
    "mcore_ep_groups",
    "use_ep_overlap_schedule",
]
