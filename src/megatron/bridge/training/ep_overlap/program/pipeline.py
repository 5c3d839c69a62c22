"""The roles and phases of a training step's work (no torch): which half of a microbatch's work a unit does
(:class:`Role`: forward or backward) and where a step sits in the pipeline's order (:class:`Phase`)."""

from enum import StrEnum


class Role(StrEnum):
    """Which half of a microbatch's work: its forward or its backward (the letters of the text forms)."""

    FORWARD = "F"
    BACKWARD = "B"


FORWARD, BACKWARD = Role.FORWARD, Role.BACKWARD


class Phase(StrEnum):
    """Where a step sits: warm-up, steady (``PAIRED`` with overlap, ``STEADY`` without), cool-down, forward, plain."""

    WARMUP = "warmup"
    PAIRED = "paired"
    STEADY = "steady"
    COOLDOWN = "cooldown"
    FORWARD = "forward"
    PLAIN = "plain"
