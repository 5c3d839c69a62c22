"""What one unit computes on one chunk, as the runtime's nodes take it."""

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class UnitInput:
    """What one unit computes on one chunk: the chunk (or its packed view), the unit's number, its tokens and labels,
    and the loss's normalizer (None: the driver normalizes, as Megatron-Core's does)."""

    chunk: Any
    unit: int
    tokens: torch.Tensor
    labels: torch.Tensor
    normalizer: Any
