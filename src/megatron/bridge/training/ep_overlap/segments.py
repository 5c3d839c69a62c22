"""Full activation recompute: which layers of a model chunk are replayed in backward, as Megatron-Core chooses them.

Contract:
    * ``recompute_granularity="full"`` with ``recompute_method`` and ``recompute_num_layers`` (Megatron-Core's
      fields, per model chunk, i.e. per virtual pipeline stage): ``uniform`` cuts the chunk's layers into segments
      of ``recompute_num_layers`` (the last one may be shorter), every one recomputed; ``block`` recomputes the
      first ``recompute_num_layers`` layers, each its own segment, and keeps the rest.
    * A recomputed segment keeps only its input in the forward; backward replays the segment's forward (with
      autograd) just before the backward of its last layer, then runs its layers' backward. Losses and gradients
      are those of keeping everything, bitwise: the replay runs the same ops on the same input.
    * :func:`full_recompute_problems` names, one line each, the settings that do not say which layers to replay.
      Anything else about full recompute (dropout, what runs the layers) is the EP-overlap rules' and the model's.
"""

METHODS = ("uniform", "block")


def full_recompute_problems(config) -> list[str]:
    """One line per full-recompute field of ``config`` (read by name) that names no segments: field, value, fix."""
    if getattr(config, "recompute_granularity", None) != "full":
        return []
    method, count = getattr(config, "recompute_method", None), getattr(config, "recompute_num_layers", None)
    problems = []
    if method not in METHODS:
        problems.append(
            f"recompute_method={method!r}: full recompute replays 'uniform' segments or the first layers "
            "('block'); fix: set recompute_method='uniform' (or 'block')"
        )
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        problems.append(
            f"recompute_num_layers={count!r}: full recompute needs the layers per segment ('uniform') or the number "
            "of layers recomputed ('block'); fix: set a positive integer, e.g. recompute_num_layers=1"
        )
    return problems


def recompute_segments(config, num_layers: int) -> tuple[tuple[int, int], ...]:
    """The recomputed segments of a chunk of ``num_layers`` layers, as ``(first, stop)`` layer positions in the
    chunk, in order; none unless ``config`` asks for full recompute (and its fields are valid)."""
    if getattr(config, "recompute_granularity", None) != "full" or full_recompute_problems(config):
        return ()
    n = config.recompute_num_layers
    if config.recompute_method == "uniform":
        return tuple((i, min(i + n, num_layers)) for i in range(0, num_layers, n))
    return tuple((i, i + 1) for i in range(min(n, num_layers)))


def segment_of(segments: tuple[tuple[int, int], ...], layer: int) -> tuple[int, int] | None:
    """The segment that holds ``layer`` (a position in the chunk), or None when it is not recomputed."""
    return next((s for s in segments if s[0] <= layer < s[1]), None)
