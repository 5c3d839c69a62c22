"""``chunk_for(model)``: the Megatron-Core plan for a model class, or one line saying the class is not scheduled."""

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.hybrid.hybrid_model import HybridModel

from megatron.bridge.training.ep_overlap.mcore.base import McoreChunk
from megatron.bridge.training.ep_overlap.mcore.gpt import McoreGPTChunk
from megatron.bridge.training.ep_overlap.mcore.hybrid import McoreHybridChunk
from megatron.bridge.training.ep_overlap.mcore.vision_language import McoreVisionLanguageChunk, is_vision_language

PLANS = {GPTModel: McoreGPTChunk, HybridModel: McoreHybridChunk}


def chunk_for(model: torch.nn.Module, *, delay_wgrad: bool = False) -> McoreChunk:
    """The plan for ``model`` (a ``GPTModel``, ``HybridModel`` or Bridge's ``Qwen3VLModel``, whole or one chunk);
    ValueError, one line with its fix, for another class or a feature the plan does not schedule."""
    for model_class, plan_class in PLANS.items():
        if isinstance(model, model_class):
            return plan_class(model, delay_wgrad=delay_wgrad)
    if is_vision_language(model):  # Bridge's class, recognized without importing Bridge's models here
        return McoreVisionLanguageChunk(model, delay_wgrad=delay_wgrad)
    raise ValueError(
        f"{type(model).__name__}: the EP-overlap plan runs Megatron-Core's GPTModel and HybridModel and "
        "Megatron-Bridge's Qwen3VLModel (whole or a pipeline chunk), and no other model class yet; fix: build one of "
        "those, or turn overlap_moe_expert_parallel_comm off for this model"
    )
