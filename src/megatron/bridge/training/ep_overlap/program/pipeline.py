"""The roles and phases of a training step's work (no torch): which half of a microbatch's work a unit does
(:class:`Role`: forward or backward), where a step sits in the pipeline's order (:class:`Phase`), and a pipeline
rank's steps as data (:class:`PipelineStep`, with its P2P :class:`Transfer`s)."""

from dataclasses import dataclass
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


@dataclass(frozen=True)
class Transfer:
    """One P2P transfer of a step: activation (``F``) or gradient (``B``) of (microbatch, chunk) to/from a rank."""

    kind: str
    microbatch: int
    chunk: int  # global model chunk id: F, the chunk the activation enters; B, the chunk whose output it is
    peer: int

    def tag(self, num_chunks: int) -> int:
        """Unique within a training step, equal on both ends."""
        return (self.microbatch * num_chunks + self.chunk) * 2 + (self.kind == BACKWARD)


@dataclass(frozen=True)
class PipelineStep:
    """One step of the driver on one pipeline rank: ``forward``/``backward`` are (microbatch, virtual stage) or
    None; ``partner`` a second microbatch of the same direction (edge pairing); ``recv``/``send`` its transfers;
    ``weight`` a deferred weight gradient (DualPipeV's W) of (microbatch, virtual stage)."""

    phase: Phase
    forward: tuple[int, int] | None
    backward: tuple[int, int] | None
    recv: tuple[Transfer, ...] = ()
    send: tuple[Transfer, ...] = ()
    partner: tuple[int, int] | None = None
    weight: tuple[int, int] | None = None

    @property
    def paired(self) -> bool:
        return self.forward is not None and self.backward is not None

    @property
    def overlapped(self) -> bool:
        return self.paired or self.partner is not None
