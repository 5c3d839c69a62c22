"""Megatron-Core models under the EP-overlap schedule.

``layer.py``: a decoder layer (and the compute layers before it) cut into the schedule's node functions.
``base.py``, ``gpt.py``, ``hybrid.py``, ``vision_language.py``: :class:`McoreChunk` and its ``GPTModel``,
``HybridModel`` and Megatron-Bridge ``Qwen3VLModel`` plans (a whole model or one pipeline chunk, as the engine runs
it). ``factory.py``: :func:`chunk_for`, the plan for either.
``hook.py``: :func:`use_ep_overlap_schedule`, the Megatron-Bridge pre-wrap hook that makes Megatron-Core's own
combined 1F1B driver run the schedule program's steps. ``forward_backward.py``: :func:`get_forward_backward_func`,
Megatron-Core's, except for the plain 1F1B pipeline with the overlap on, which Megatron-Core does not pair.
"""

from megatron.bridge.training.ep_overlap.mcore.base import McoreChunk, mcore_ep_groups
from megatron.bridge.training.ep_overlap.mcore.factory import chunk_for
from megatron.bridge.training.ep_overlap.mcore.forward_backward import (
    forward_backward_pipelining_with_ep_overlap,
    get_forward_backward_func,
)
from megatron.bridge.training.ep_overlap.mcore.gpt import McoreGPTChunk
from megatron.bridge.training.ep_overlap.mcore.hook import (
    DEFAULT_TIMEOUT,
    EPOverlapPlanBuilder,
    EPOverlapSchedulePlan,
    use_ep_overlap_schedule,
)
from megatron.bridge.training.ep_overlap.mcore.hybrid import McoreHybridChunk
from megatron.bridge.training.ep_overlap.mcore.layer import McoreComputeRun, McoreLayer, McoreRouting
from megatron.bridge.training.ep_overlap.mcore.vision_language import McoreVisionLanguageChunk

__all__ = [
    "DEFAULT_TIMEOUT",
    "EPOverlapPlanBuilder",
    "EPOverlapSchedulePlan",
    "McoreComputeRun",
    "McoreGPTChunk",
    "McoreHybridChunk",
    "McoreLayer",
    "McoreChunk",
    "McoreRouting",
    "McoreVisionLanguageChunk",
    "mcore_ep_groups",
    "chunk_for",
    "forward_backward_pipelining_with_ep_overlap",
    "get_forward_backward_func",
    "use_ep_overlap_schedule",
]
