"""Reference MoE GPT in plain PyTorch, built from Megatron config field names."""

from ep_overlap_lab.moe_gpt.config import MoEGPTConfig
from ep_overlap_lab.moe_gpt.model import MoEGPTModel, build_pipeline_chunks

__all__ = ["MoEGPTConfig", "MoEGPTModel", "build_pipeline_chunks"]
