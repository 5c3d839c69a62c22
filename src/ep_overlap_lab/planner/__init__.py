"""The planner: prices the engine's schedule program before a run (pure Python; no torch).

``simulate`` charges every op of the program a cost and runs one rank's compute and link; ``pipeline`` runs every
stage of a pipelined step at once; ``measured`` reads costs from a recorded plain step; ``cost_model`` derives them
from a model shape and a hardware profile; ``memory`` counts the activations held.
"""

from ep_overlap_lab.planner.measured import (
    comm_kind,
    costs_from_records,
    exposed_by_phase,
    exposed_by_phase_and_kind,
)
from ep_overlap_lab.planner.pipeline import PipelinePrediction, in_flight, simulate_pipeline
from ep_overlap_lab.planner.simulate import (
    Comparison,
    LayerCosts,
    Link,
    Prediction,
    StepCosts,
    best_choice,
    predict,
    simulate,
    step_by_wgrad_window,
)

__all__ = [
    "Comparison",
    "LayerCosts",
    "Link",
    "PipelinePrediction",
    "Prediction",
    "StepCosts",
    "best_choice",
    "comm_kind",
    "costs_from_records",
    "exposed_by_phase",
    "exposed_by_phase_and_kind",
    "in_flight",
    "predict",
    "simulate",
    "simulate_pipeline",
    "step_by_wgrad_window",
]
