"""The engine: executes the schedule program with torch (nodes, lanes, P2P, records, the plain path)."""

from megatron.bridge.training.ep_overlap.engine.driver import Engine, StepResult
from megatron.bridge.training.ep_overlap.engine.records import StepRecorder, StepStats

__all__ = ["Engine", "StepRecorder", "StepResult", "StepStats"]
