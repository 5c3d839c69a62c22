"""The schedule program's words: every op declared once, the op and window records, and the short runs of ops that
one unit's layer goes through (which ``steps.py`` and ``replay.py`` lay out beside another unit's).

Contract:
    * An op is ``(kind, name)`` on one unit, at one layer of its chunk or at the chunk's ends (:data:`OPS`, with
      what of its unit it reads and writes); a runner runs it as its method ``<kind>_<name>`` (``Op.method``).
    * A :class:`Window` is ops in host order under a label (what ``--print_schedule`` prints).
    * The runners' typed protocols are generated from :data:`OPS`: :data:`LayerRunner` (an op at a layer),
      :data:`ChunkRunner` (at a chunk's ends) and :data:`PlainRunner` (a whole chunk, overlap off), one method each.
      Every runner (the engine's nodes and plain run, the simulator's and the memory count's charges) is checked
      against them by a test, so an op added here without a runner fails it.
    * No torch here.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable


class OpKind(StrEnum):
    """What an op does on the host: run a node, start or wait for a transfer, run a delayed wgrad, or run a whole
    chunk through ordinary autograd (overlap off)."""

    COMPUTE = "compute"
    LAUNCH = "launch"
    WAIT = "wait"
    WGRAD = "wgrad"
    PLAIN = "plain"


COMPUTE, LAUNCH, WAIT, WGRAD, PLAIN = OpKind


# Every op, declared once: (kind, name) -> (what of its unit the op reads, what it writes): "x" the activation,
# "g" the gradient, None nothing. The runner's method for it is ``<kind>_<name>`` (``Op.method``).
OPS: dict[tuple[OpKind, str], tuple[str | None, str | None]] = {
    (OpKind.COMPUTE, "embedding"): (None, "x"),
    (OpKind.WAIT, "recv_activation"): (None, "x"),
    (OpKind.COMPUTE, "pre_dispatch"): ("x", None),  # attention, pre-MLP norm, router, permute
    (OpKind.LAUNCH, "split"): (None, None),  # the split sizes go out
    (OpKind.WAIT, "split"): (None, None),  # ... and are known (the dispatch's host sync)
    (OpKind.LAUNCH, "dispatch"): (None, None),
    (OpKind.WAIT, "dispatch"): (None, None),
    (OpKind.COMPUTE, "experts"): (None, None),
    (OpKind.LAUNCH, "combine"): (None, None),
    (OpKind.WAIT, "combine"): (None, None),
    (OpKind.COMPUTE, "combine"): (None, "x"),  # unpermute, residual add: the layer's output
    (OpKind.COMPUTE, "head"): ("x", None),
    (OpKind.LAUNCH, "send_activation"): ("x", None),
    (OpKind.COMPUTE, "head_bwd"): (None, "g"),
    (OpKind.WAIT, "recv_grad"): (None, "g"),
    (OpKind.COMPUTE, "combine_bwd"): ("g", None),
    (OpKind.LAUNCH, "combine_bwd"): (None, None),
    (OpKind.WAIT, "combine_bwd"): (None, None),
    (OpKind.COMPUTE, "experts_bwd"): (None, None),  # dgrad, and wgrad unless delayed
    (OpKind.LAUNCH, "dispatch_bwd"): (None, None),
    (OpKind.WGRAD, "experts"): (None, None),
    (OpKind.WAIT, "dispatch_bwd"): (None, None),
    (OpKind.COMPUTE, "pre_dispatch_bwd"): (None, "g"),
    # Full recompute: B's replay of a recomputed segment's forward, before the backward of its last layer; "r" is
    # the replayed activation, from the segment's kept input through each layer's replayed combine
    (OpKind.COMPUTE, "replay_input"): (None, "r"),
    (OpKind.COMPUTE, "replay_pre_dispatch"): ("r", None),
    (OpKind.LAUNCH, "replay_dispatch"): (None, None),
    (OpKind.WAIT, "replay_dispatch"): (None, None),
    (OpKind.COMPUTE, "replay_experts"): (None, None),
    (OpKind.LAUNCH, "replay_combine"): (None, None),
    (OpKind.WAIT, "replay_combine"): (None, None),
    (OpKind.COMPUTE, "replay_combine"): (None, "r"),
    (OpKind.WGRAD, "attention"): (None, None),
    (OpKind.COMPUTE, "embedding_bwd"): ("g", None),
    (OpKind.LAUNCH, "send_grad"): ("g", None),
    (OpKind.PLAIN, "forward"): (None, None),
    (OpKind.PLAIN, "backward"): (None, None),
}
# The ops at a chunk's ends (run by the unit's runner, not one of its layers'), and a whole chunk's (overlap off).
CHUNK_END_OPS = frozenset(
    (kind, name)
    for kind, name in OPS
    if name in ("embedding", "recv_activation", "head", "send_activation", "head_bwd", "recv_grad", "embedding_bwd",
                "send_grad")
)  # fmt: skip
PLAIN_OPS = frozenset((kind, name) for kind, name in OPS if kind == OpKind.PLAIN)
LAYER_OPS = frozenset(OPS) - CHUNK_END_OPS - PLAIN_OPS


def runner_protocol(name: str, ops) -> type:
    """A runtime-checkable protocol with one method ``<kind>_<name>`` per op of ``ops``."""

    def method(self, *args: Any) -> Any: ...

    namespace = {f"{kind}_{op}": method for kind, op in sorted(ops)}
    return runtime_checkable(type(name, (Protocol,), namespace))


LayerRunner = runner_protocol("LayerRunner", LAYER_OPS)
ChunkRunner = runner_protocol("ChunkRunner", CHUNK_END_OPS)
PlainRunner = runner_protocol("PlainRunner", PLAIN_OPS)


@dataclass(frozen=True)
class Op:
    """One operation of the host: ``kind`` and ``name`` as in :data:`OPS`, on ``unit``, at ``layer`` (its position
    in the unit's chunk) or at the chunk's ends (None)."""

    kind: OpKind
    name: str
    unit: int
    layer: int | None = None

    def __post_init__(self):
        if (self.kind, self.name) not in OPS:
            raise ValueError(f"{self.kind} {self.name}: not an op of the program (program.ops.OPS)")

    @property
    def method(self) -> str:
        """The nodes' method that runs it."""
        return f"{self.kind}_{self.name}"

    def __str__(self) -> str:
        return f"{self.kind} {self.name} u{self.unit}" + ("" if self.layer is None else f" L{self.layer}")


@dataclass(frozen=True)
class Window:
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
    """One layer's forward replayed, each all-to-all waited for at once (nothing of the other unit beside it)."""
    return _replay_to_dispatch(u, j) + _replay_to_combine(u, j) + _replay_output(u, j)


def _replay_below(u: int, segment: tuple[int, int]) -> list[Op]:
    """A segment's replay up to (not including) its last layer: its kept input, then each layer below the last."""
    first, stop = segment
    return [Op(COMPUTE, "replay_input", u, first)] + [op for j in range(first, stop - 1) for op in _replay_layer(u, j)]


def _replay_start(u: int, k: int) -> list[Op]:
    """Layer ``k``'s replay (a one-layer segment) from its kept input up to its dispatch, left in flight."""
    return [Op(COMPUTE, "replay_input", u, k)] + _replay_to_dispatch(u, k)


def _replay_ahead(u: int, k: int) -> list[Op]:
    """Layer ``k``'s replay (a one-layer segment) up to its combine, which is left in flight for the next step."""
    return _replay_start(u, k) + _replay_to_combine(u, k)
