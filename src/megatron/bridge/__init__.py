"""Megatron-Bridge slice: MoE expert-parallel communication overlap."""
