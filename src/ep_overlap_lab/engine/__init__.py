"""The lab's engine: a training step of the reference model (or a Megatron-Core chunk) run through the schedule
program by the payload's runtime, with its own gradient sync, loss normalisation and P2P (``driver.py``, ``grads.py``,
``p2p.py``), the plain path (``plain.py``) and the bytes held for backward (``saved.py``). No Bridge training step
calls it: Megatron-Core's driver does that job there (``megatron.bridge.training.ep_overlap.mcore``)."""

from ep_overlap_lab.engine.driver import Engine, StepResult
from ep_overlap_lab.engine.ep_overlap_engine import EPOverlapEngine
from ep_overlap_lab.step_stats import StepStats
from megatron.bridge.training.ep_overlap.runtime.records import StepRecorder

__all__ = ["EPOverlapEngine", "Engine", "StepRecorder", "StepResult", "StepStats"]
