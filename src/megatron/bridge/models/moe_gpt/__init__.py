"""Reference MoE GPT in plain PyTorch, built from Megatron config field names."""

from megatron.bridge.models.moe_gpt.config import MoEGPTConfig
from megatron.bridge.models.moe_gpt.model import MoEGPTModel, build_pipeline_chunks

__all__ = ["MoEGPTConfig", "MoEGPTModel", "build_pipeline_chunks"]
