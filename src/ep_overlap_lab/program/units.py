"""The schedule's units (no torch): a whole microbatch, or (``moe_ep_overlap_chunks = 2``, PP = 1) one batch half of
a microbatch the schedule runs alone. A chunked microbatch's gradients reach each parameter in two contributions: not
bitwise equal to the plain path, hence opt-in."""

from dataclasses import dataclass

CHUNK_CHOICES = (1, 2)


@dataclass(frozen=True)
class Unit:
    """A whole microbatch or one half of it: what one sequence of nodes runs."""

    microbatch: int
    half: int | None = None  # None: the whole microbatch; 0 or 1: which half of its sequences

    def rows(self, batch: int) -> slice:
        if self.half is None:
            return slice(0, batch)
        cut = (batch + 1) // 2
        return slice(0, cut) if self.half == 0 else slice(cut, batch)

    def size(self, batch: int) -> int:
        rows = self.rows(batch)
        return rows.stop - rows.start


def chunked_microbatches(num_microbatches: int, *, forward_only: bool = False) -> list[int]:
    """The microbatches the schedule runs alone somewhere, which chunking splits."""
    n = num_microbatches
    if forward_only:  # forwards go two by two; an odd count leaves the last one alone
        return [n - 1] if n % 2 else []
    return [0] if n == 1 else [0, n - 1]


def units(num_microbatches: int, chunks: int, *, forward_only: bool = False) -> list[Unit]:
    """The schedule's units in order: each microbatch whole, or its two halves in its place."""
    split = set(chunked_microbatches(num_microbatches, forward_only=forward_only)) if chunks == 2 else set()
    return [unit for m in range(num_microbatches) for unit in ((Unit(m, 0), Unit(m, 1)) if m in split else (Unit(m),))]
