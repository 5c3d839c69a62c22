"""Full activation recompute's segments: which of a chunk's layers a position belongs to.

Per model chunk (derived once, ``settings.Settings.segments``), by ``recompute_method``: ``uniform`` cuts the layers
into segments of ``recompute_num_layers`` (the last may be shorter); ``block`` makes each of the first
``recompute_num_layers`` layers its own segment.
"""


def segment_of(segments: tuple[tuple[int, int], ...], layer: int) -> tuple[int, int] | None:
    """The segment that holds ``layer`` (a position in the chunk), or None when it is not recomputed."""
    return next((s for s in segments if s[0] <= layer < s[1]), None)
