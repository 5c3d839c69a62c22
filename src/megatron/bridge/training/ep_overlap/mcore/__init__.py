"""Megatron-Core models under the EP-overlap schedule: the chunk adapters (:func:`chunk_for`), the Megatron-Bridge
pre-wrap hook (:func:`use_ep_overlap_schedule`) and the forward-backward function (:func:`get_forward_backward_func`).
"""

from megatron.bridge.training.ep_overlap.mcore.base import mcore_ep_groups
from megatron.bridge.training.ep_overlap.mcore.forward_backward import get_forward_backward_func
from megatron.bridge.training.ep_overlap.mcore.gpt import McoreGPTChunk
from megatron.bridge.training.ep_overlap.mcore.hook import chunk_for, use_ep_overlap_schedule

__all__ = ["McoreGPTChunk", "chunk_for", "get_forward_backward_func", "mcore_ep_groups", "use_ep_overlap_schedule"]
