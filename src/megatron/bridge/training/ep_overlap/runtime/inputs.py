"""What one unit computes on one chunk, as the runtime's nodes take it."""

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class UnitInput:
    """What one unit computes on one chunk: the chunk (or its view for a packed microbatch), the unit's number (its
    records carry it), its token ids and labels (a chunked microbatch's half), and the loss's normalizer (None: the
    driver normalizes, as Megatron-Core's does)."""

    chunk: Any
    unit: int
    tokens: torch.Tensor
    labels: torch.Tensor
    normalizer: Any
