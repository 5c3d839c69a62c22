"""Full activation recompute's segments: which of a chunk's layers a position belongs to.

Contract:
    * ``recompute_granularity="full"`` with ``recompute_method`` and ``recompute_num_layers`` (Megatron-Core's
      fields, per model chunk, i.e. per virtual pipeline stage) cut a chunk into segments
      (``settings.Settings.segments``, the one place that derives them): ``uniform`` into segments of
      ``recompute_num_layers`` (the last one may be shorter), every one recomputed; ``block`` recomputes the first
      ``recompute_num_layers`` layers, each its own segment, and keeps the rest.
    * A recomputed segment keeps only its input in the forward; backward replays the segment's forward (with
      autograd) just before the backward of its last layer, then runs its layers' backward. Losses and gradients
      are those of keeping everything, bitwise: the replay runs the same ops on the same input.
"""


def segment_of(segments: tuple[tuple[int, int], ...], layer: int) -> tuple[int, int] | None:
    """The segment that holds ``layer`` (a position in the chunk), or None when it is not recomputed."""
    return next((s for s in segments if s[0] <= layer < s[1]), None)
