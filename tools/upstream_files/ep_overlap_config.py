"""The plugin's entry point, kept so a recipe written for the plugin runs unchanged: here ``CommOverlapConfig`` itself
checks every EP-overlap rule."""

from megatron.bridge.training.comm_overlap import CommOverlapConfig as EPOverlapCommOverlapConfig

__all__ = ["EPOverlapCommOverlapConfig"]
