"""The schedule's units: a whole microbatch, or (chunked unpaired phases) one half of it.

Contract:
    * With ``moe_ep_overlap_chunks = 2`` (PP = 1, overlap on) each microbatch that the schedule runs alone somewhere
      is split along the batch dimension (the first ``ceil(B / 2)`` sequences, then the rest): the first one (its
      forward opens the step) and the last one (its backward closes it), or the only one; in a forward-only step,
      whose forwards run two by two, the last one of an odd count.
    * Units are numbered in microbatch order (:func:`units`: the first microbatch's halves are units 0 and 1,
      microbatch m in between is unit m + 1, the last one's halves follow); records number nodes by unit.
    * Where a split microbatch runs alone, the program pairs its halves with each other; where it is paired with
      another microbatch, both halves take its place, node by node, so every window keeps a whole microbatch's
      compute and comm. The schedule itself is unchanged, and so is the peak of live activations.
    * Numerics: a chunked microbatch's loss is the sum of its halves' (first half first) and its gradients reach
      each parameter in two contributions instead of one, so results differ from the plain path by rounding. It is
      the one option that is not bitwise equal to the plain path, and so it is opt-in. What chunking cannot serve
      is refused by the rules table (``moe_overlap_rules``), one line per problem.
"""

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
        """How many of a microbatch's ``batch`` sequences the unit runs."""
        rows = self.rows(batch)
        return rows.stop - rows.start


def chunked_microbatches(num_microbatches: int, *, forward_only: bool = False) -> list[int]:
    """The microbatches the schedule runs alone somewhere (see the module docstring), which chunking splits."""
    n = num_microbatches
    if forward_only:  # forwards go two by two; an odd count leaves the last one alone
        return [n - 1] if n % 2 else []
    return [0] if n == 1 else [0, n - 1]


def units(num_microbatches: int, chunks: int, *, forward_only: bool = False) -> list[Unit]:
    """The schedule's units in order: each microbatch whole, or its two halves in its place."""
    split = set(chunked_microbatches(num_microbatches, forward_only=forward_only)) if chunks == 2 else set()
    return [unit for m in range(num_microbatches) for unit in ((Unit(m, 0), Unit(m, 1)) if m in split else (Unit(m),))]
