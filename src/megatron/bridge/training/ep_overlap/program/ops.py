"""The schedule program's words (no torch): every op declared once (:data:`OPS`: its runner method, what it reads
and writes, which runner runs it), the op and window records, and the short runs of ops a unit's layer goes
through."""

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class OpKind(StrEnum):
    """What an op does: run a node, start or wait for a transfer, run a delayed wgrad, or run a whole chunk."""

    COMPUTE = "compute"
    LAUNCH = "launch"
    WAIT = "wait"
    WGRAD = "wgrad"
    PLAIN = "plain"


COMPUTE, LAUNCH, WAIT, WGRAD, PLAIN = OpKind


# Which runner runs an op: its layer's, the unit's at the chunk's ends, or the unit's for a whole chunk (overlap off)
LAYER, ENDS, WHOLE = "layer", "ends", "whole"


@dataclass(frozen=True)
class OpSpec:
    """One op: its runner ``method``, what of its unit it ``reads``/``writes`` (``"x"`` activation, ``"g"`` gradient,
    ``"r"`` replayed one), and whether it is a ``host_sync`` (the host blocks, even on a device lane)."""

    method: str
    reads: str | None = None
    writes: str | None = None
    at: str = LAYER
    host_sync: bool = False


OPS: dict[tuple[OpKind, str], OpSpec] = {
    (OpKind.COMPUTE, "embedding"): OpSpec("compute_embedding", writes="x", at=ENDS),
    # the engine's pipeline P2P goes through host memory, so a receive blocks the host on any lane
    (OpKind.WAIT, "recv_activation"): OpSpec("wait_recv_activation", writes="x", at=ENDS, host_sync=True),
    (OpKind.COMPUTE, "pre_dispatch"): OpSpec("compute_pre_dispatch", reads="x"),
    (OpKind.LAUNCH, "split"): OpSpec("launch_split"),
    # the split sizes are known: the dispatcher's device-to-host sync blocks the host on any lane
    (OpKind.WAIT, "split"): OpSpec("wait_split", host_sync=True),
    (OpKind.LAUNCH, "dispatch"): OpSpec("launch_dispatch"),
    (OpKind.WAIT, "dispatch"): OpSpec("wait_dispatch"),
    (OpKind.COMPUTE, "experts"): OpSpec("compute_experts"),
    (OpKind.LAUNCH, "combine"): OpSpec("launch_combine"),
    (OpKind.WAIT, "combine"): OpSpec("wait_combine"),
    (OpKind.COMPUTE, "combine"): OpSpec("compute_combine", writes="x"),
    (OpKind.COMPUTE, "head"): OpSpec("compute_head", reads="x", at=ENDS),
    (OpKind.LAUNCH, "send_activation"): OpSpec("launch_send_activation", reads="x", at=ENDS),
    (OpKind.COMPUTE, "head_bwd"): OpSpec("compute_head_bwd", writes="g", at=ENDS),
    (OpKind.WAIT, "recv_grad"): OpSpec("wait_recv_grad", writes="g", at=ENDS, host_sync=True),
    (OpKind.COMPUTE, "combine_bwd"): OpSpec("compute_combine_bwd", reads="g"),
    (OpKind.LAUNCH, "combine_bwd"): OpSpec("launch_combine_bwd"),
    (OpKind.WAIT, "combine_bwd"): OpSpec("wait_combine_bwd"),
    (OpKind.COMPUTE, "experts_bwd"): OpSpec("compute_experts_bwd"),
    (OpKind.LAUNCH, "dispatch_bwd"): OpSpec("launch_dispatch_bwd"),
    (OpKind.WGRAD, "experts"): OpSpec("wgrad_experts"),
    (OpKind.WAIT, "dispatch_bwd"): OpSpec("wait_dispatch_bwd"),
    (OpKind.COMPUTE, "pre_dispatch_bwd"): OpSpec("compute_pre_dispatch_bwd", writes="g"),
    (OpKind.COMPUTE, "replay_input"): OpSpec("compute_replay_input", writes="r"),
    (OpKind.COMPUTE, "replay_pre_dispatch"): OpSpec("compute_replay_pre_dispatch", reads="r"),
    (OpKind.LAUNCH, "replay_dispatch"): OpSpec("launch_replay_dispatch"),
    (OpKind.WAIT, "replay_dispatch"): OpSpec("wait_replay_dispatch"),
    (OpKind.COMPUTE, "replay_experts"): OpSpec("compute_replay_experts"),
    (OpKind.LAUNCH, "replay_combine"): OpSpec("launch_replay_combine"),
    (OpKind.WAIT, "replay_combine"): OpSpec("wait_replay_combine"),
    (OpKind.COMPUTE, "replay_combine"): OpSpec("compute_replay_combine", writes="r"),
    (OpKind.WGRAD, "attention"): OpSpec("wgrad_attention"),
    (OpKind.COMPUTE, "embedding_bwd"): OpSpec("compute_embedding_bwd", reads="g", at=ENDS),
    (OpKind.LAUNCH, "send_grad"): OpSpec("launch_send_grad", reads="g", at=ENDS),
    (OpKind.PLAIN, "forward"): OpSpec("plain_forward", at=WHOLE),
    (OpKind.PLAIN, "backward"): OpSpec("plain_backward", at=WHOLE),
}


@dataclass(frozen=True)
class Op:
    """One host operation: ``(kind, name)`` of :data:`OPS` on ``unit``, at ``layer`` or the chunk's ends (None)."""

    kind: OpKind
    name: str
    unit: int
    layer: int | None = None

    def __post_init__(self):
        if (self.kind, self.name) not in OPS:
            raise ValueError(f"{self.kind} {self.name}: not an op of the program (program.ops.OPS)")
        object.__setattr__(self, "_hash", hash((self.kind, self.name, self.unit, self.layer)))

    def __hash__(self) -> int:  # computed once: a step's ops are a cache key (interpreter.issue_order)
        return self._hash

    @property
    def spec(self) -> OpSpec:
        return OPS[(self.kind, self.name)]

    @property
    def lane(self) -> str | None:
        """Whose order the op keeps across units: ``"compute"`` (compute, whose order is the numbers, and the waits
        queued among it), ``"comm"`` (peers pair collectives by issue order), None for a host sync."""
        if self.spec.host_sync:
            return None
        return "comm" if self.kind == OpKind.LAUNCH else "compute"

    def __str__(self) -> str:
        return f"{self.kind} {self.name} u{self.unit}" + ("" if self.layer is None else f" L{self.layer}")


@dataclass(frozen=True)
class Window:
    """Ops in program order under a label: one microbatch's transfers and the other's compute beside them."""

    label: str
    ops: tuple[Op, ...]


def _backward_begin(u: int, shape) -> Op:
    return Op(COMPUTE, "head_bwd", u) if shape.last else Op(WAIT, "recv_grad", u)


def _backward_end(u: int, shape) -> Op:
    return Op(COMPUTE, "embedding_bwd", u) if shape.first else Op(LAUNCH, "send_grad", u)


def _experts_bwd(u: int, k: int, moe: bool, delay_wgrad: bool) -> list[Op]:
    ops = _experts_dgrad(u, k) + [Op(LAUNCH, "dispatch_bwd", u, k)]
    return ops + ([Op(WGRAD, "experts", u, k)] if delay_wgrad and moe else [])


def _combine_bwd(u: int, k: int) -> list[Op]:
    return [Op(COMPUTE, "combine_bwd", u, k), Op(LAUNCH, "combine_bwd", u, k)]


def _experts_dgrad(u: int, k: int) -> list[Op]:
    return [Op(WAIT, "combine_bwd", u, k), Op(COMPUTE, "experts_bwd", u, k)]


def _pre_dispatch_bwd(u: int, k: int) -> list[Op]:
    return [Op(WAIT, "dispatch_bwd", u, k), Op(COMPUTE, "pre_dispatch_bwd", u, k)]


def _attention_wgrad(b: Sequence[int], k: int | None, delay_wgrad: bool) -> list[Op]:
    return [Op(WGRAD, "attention", u, k) for u in b] if delay_wgrad and k is not None else []


def _replay_to_dispatch(u: int, j: int) -> list[Op]:
    return [Op(COMPUTE, "replay_pre_dispatch", u, j), Op(LAUNCH, "replay_dispatch", u, j)]


def _replay_to_combine(u: int, j: int) -> list[Op]:
    return [Op(WAIT, "replay_dispatch", u, j), Op(COMPUTE, "replay_experts", u, j), Op(LAUNCH, "replay_combine", u, j)]


def _replay_output(u: int, j: int) -> list[Op]:
    return [Op(WAIT, "replay_combine", u, j), Op(COMPUTE, "replay_combine", u, j)]


def _replay_layer(u: int, j: int) -> list[Op]:
    return _replay_to_dispatch(u, j) + _replay_to_combine(u, j) + _replay_output(u, j)


def _replay_below(u: int, segment: tuple[int, int]) -> list[Op]:
    """A segment's replay up to (not including) its last layer."""
    first, stop = segment
    return [Op(COMPUTE, "replay_input", u, first)] + [op for j in range(first, stop - 1) for op in _replay_layer(u, j)]


def _replay_start(u: int, k: int) -> list[Op]:
    """Layer ``k``'s replay (a one-layer segment) up to its dispatch, left in flight."""
    return [Op(COMPUTE, "replay_input", u, k)] + _replay_to_dispatch(u, k)


def _replay_ahead(u: int, k: int) -> list[Op]:
    return _replay_start(u, k) + _replay_to_combine(u, k)
