"""A chunked microbatch given as its halves, and per-half losses summed back per microbatch: how a test feeds
chunking's units to a run that has no chunking."""

import torch

from ep_overlap_lab.program.units import Unit, units


def as_units(microbatches: list) -> tuple[list, list[Unit]]:
    """The microbatches chunking splits, given as separate microbatches (its halves), and the units they are."""
    plan = units(len(microbatches), 2)
    split = []
    for unit in plan:
        tokens, labels = microbatches[unit.microbatch]
        rows = unit.rows(tokens.shape[0])
        split.append((tokens[rows], labels[rows]))
    return split, plan


def summed_per_microbatch(plan: list[Unit], losses: list[torch.Tensor]) -> torch.Tensor:
    """Per-unit losses summed back per microbatch, first half first (as the engine sums a chunked microbatch's)."""
    summed: dict[int, torch.Tensor] = {}
    for unit, loss in zip(plan, losses):
        summed[unit.microbatch] = loss if unit.microbatch not in summed else summed[unit.microbatch] + loss
    return torch.stack([summed[m] for m in sorted(summed)])
