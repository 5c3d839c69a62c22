"""Which global layers each pipeline model chunk holds, the way Megatron-Core splits a model.

Model chunk ``v * P + r`` sits on pipeline rank r as its virtual stage v (P = pipeline_model_parallel_size, V =
virtual_pipeline_model_parallel_size or 1). A stage's layers are split evenly over its V chunks. Without
``num_layers_in_first/last_pipeline_stage`` every stage holds ``num_layers / P``; with them, the first and/or last
stage hold what they say and the stages between share the rest evenly. The embedding lives on chunk 0 and the
head and loss on chunk P V - 1. Megatron-Core's ``TransformerConfig`` refuses splits that do not divide.
"""

from typing import Any


def chunk_layers(
    num_layers: int,
    pipeline_size: int,
    virtual_size: int = 1,
    first_stage: int | None = None,
    last_stage: int | None = None,
) -> list[list[int]]:
    """Global layer numbers of every model chunk, indexed by chunk id ``v * P + r``.

    Raises:
        ValueError: When the layers cannot be split as asked (naming the count that does not divide).
    """
    P, V = pipeline_size, virtual_size
    fixed = {0: first_stage, P - 1: last_stage} if P > 1 else {}
    fixed = {stage: n for stage, n in fixed.items() if n is not None}
    middle_stages = P - len(fixed)
    middle_layers = num_layers - sum(fixed.values())
    if (
        middle_layers < 0
        or (middle_stages == 0 and middle_layers)
        or (middle_stages and middle_layers % middle_stages)
    ):
        raise ValueError(
            f"num_layers={num_layers} cannot be split over {P} pipeline stages with first stage {first_stage} and "
            f"last stage {last_stage}: the {middle_layers} remaining layers do not divide over {middle_stages} stages"
        )
    per_stage = [fixed.get(r, middle_layers // middle_stages if middle_stages else 0) for r in range(P)]
    for r, n in enumerate(per_stage):
        if n % V:
            raise ValueError(
                f"pipeline stage {r} holds {n} layers, not divisible by virtual_pipeline_model_parallel_size={V}"
            )
    chunks, start = [], 0
    for _ in range(V):
        for r in range(P):
            count = per_stage[r] // V
            chunks.append(list(range(start, start + count)))
            start += count
    return chunks


def chunk_layers_of(config: Any) -> list[list[int]]:
    """:func:`chunk_layers` for a Megatron ``TransformerConfig``."""
    return chunk_layers(
        config.num_layers,
        config.pipeline_model_parallel_size or 1,
        config.virtual_pipeline_model_parallel_size or 1,
        config.num_layers_in_first_pipeline_stage,
        config.num_layers_in_last_pipeline_stage,
    )
