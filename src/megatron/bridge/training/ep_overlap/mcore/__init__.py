"""Megatron-Core models under the EP-overlap schedule: the plans (:func:`chunk_for`), the Megatron-Bridge pre-wrap hook
(:func:`use_ep_overlap_schedule`) and the forward-backward function (:func:`get_forward_backward_func`)."""

from megatron.bridge.training.ep_overlap.mcore.base import McoreChunk, mcore_ep_groups
from megatron.bridge.training.ep_overlap.mcore.forward_backward import (
    forward_backward_pipelining_with_ep_overlap,
    get_forward_backward_func,
)
from megatron.bridge.training.ep_overlap.mcore.gpt import McoreGPTChunk
from megatron.bridge.training.ep_overlap.mcore.hook import (
    DEFAULT_TIMEOUT,
    EPOverlapPlanBuilder,
    EPOverlapSchedulePlan,
    chunk_for,
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
