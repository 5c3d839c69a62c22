"""Chunked unpaired phases: a microbatch that would run alone is split in two, and its halves run as a pair.

Contract:
    * With ``moe_ep_overlap_chunks = 2`` (PP = 1, overlap on) the engine splits along the batch dimension (the
      first ``ceil(B / 2)`` sequences, then the rest) each microbatch that its schedule runs alone somewhere: the
      first one (its forward opens the step) and the last one (its backward closes it), or the only one; in a
      forward-only step, whose forwards run two by two, the last one of an odd count.
    * Where such a microbatch runs alone, its halves run as a pair (the engine's ``forward_pair_step`` /
      ``backward_pair_step``): each half's all-to-alls hide behind the other half's compute. Where it is paired
      with another microbatch (B(0) beside F(1), F(N-1) beside B(N-2)), :class:`HalvesNodes` runs its halves node
      by node in the place of one microbatch, so every window keeps a whole microbatch's compute and comm. The
      schedule itself is unchanged, and so is the peak of live activations (two microbatches).
    * The halves are the schedule's units: records number them in order (:func:`units`: the first microbatch's
      halves are units 0 and 1, microbatch m in between is unit m + 1, the last one's halves follow).
    * Numerics: every token's forward is its own, but a chunked microbatch's loss is the sum of its halves'
      partial sums and its gradients reach each parameter in two contributions instead of one, so the results
      differ from the plain path by rounding (the tests bound it; they also check that the result is bitwise the
      plain path's fed the halves as microbatches of their own). That is why chunking is opt-in (default 1, off),
      while every other option of the schedule is bitwise equal to the plain path.
    * Losses are reported per microbatch: a chunked one's is the sum of its halves', first half first.
    * A configuration chunking cannot serve is refused before anything runs: :data:`CHUNK_RULES`, one line per
      problem with its fix. A microbatch with a single sequence cannot be split; the engine refuses it on every
      rank at once, naming the microbatch.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

CHUNK_CHOICES = (1, 2)


@dataclass(frozen=True)
class Unit:
    """A whole microbatch or one half of it: what one sequence of nodes runs (records are numbered by unit)."""

    microbatch: int
    half: int | None = None  # None: the whole microbatch; 0 or 1: which half of its sequences

    def rows(self, batch: int) -> slice:
        if self.half is None:
            return slice(0, batch)
        cut = (batch + 1) // 2
        return slice(0, cut) if self.half == 0 else slice(cut, batch)


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


class _HalvesLayer:
    """One layer of a chunked microbatch: each node runs on the first half, then on the second.

    Inputs travel as callables, one per half, so each half waits only for its own previous all-to-all; gradients
    travel as pairs of tensors.
    """

    def __init__(self, a, b):
        self.halves = (a, b)

    def pre_dispatch(self, inputs) -> None:
        for half, x in zip(self.halves, inputs):
            half.pre_dispatch(x())

    @property
    def is_moe(self) -> bool:
        return self.halves[0].is_moe

    def start_exchange(self) -> None:
        for half in self.halves:
            half.start_exchange()

    def dispatch(self) -> None:
        # Both split-size exchanges first: the second would otherwise queue behind the first half's bulk transfer.
        # (A lane that launches off the host finishes them on its helper thread, in this same order.)
        for half in self.halves:
            half.exchange_splits()
        for half in self.halves:
            half.dispatch()

    def experts(self) -> None:
        for half in self.halves:
            half.experts()

    def combine(self) -> None:
        for half in self.halves:
            half.combine()

    def combine_finish(self) -> tuple[Callable, Callable]:
        return tuple(half.combine_finish for half in self.halves)

    def combine_backward(self, grads) -> None:
        for half, grad in zip(self.halves, grads):
            half.combine_backward(grad)

    def experts_backward(self) -> None:
        for half in self.halves:
            half.experts_backward()

    def dispatch_backward(self) -> None:
        for half in self.halves:
            half.dispatch_backward()

    def expert_wgrad(self) -> None:
        for half in self.halves:
            half.expert_wgrad()

    def pre_dispatch_backward(self) -> tuple:
        return tuple(half.pre_dispatch_backward() for half in self.halves)

    def attention_wgrad(self) -> None:
        for half in self.halves:
            half.attention_wgrad()


class HalvesNodes:
    """A chunked microbatch in a paired step: the ``MicrobatchNodes`` interface over its two halves' nodes.

    ``halves`` are the two ``MicrobatchNodes``; run alone, the engine pairs them with each other instead.
    """

    def __init__(self, microbatch: int, a, b):
        self.mb, self.halves = microbatch, (a, b)
        self.first, self.last = a.first, a.last
        self.layers = [_HalvesLayer(la, lb) for la, lb in zip(a.layers, b.layers)]

    @property
    def loss(self):
        a, b = self.halves
        return a.loss + b.loss

    def forward_begin(self) -> tuple[Callable, Callable]:
        return tuple(half.forward_begin for half in self.halves)

    def forward_end(self, outputs) -> None:
        for half, x in zip(self.halves, outputs):
            half.forward_end(x())

    def backward_begin(self) -> tuple:
        return tuple(half.backward_begin() for half in self.halves)

    def backward_end(self, grads) -> None:
        for half, grad in zip(self.halves, grads):
            half.backward_end(grad)


@dataclass(frozen=True)
class ChunkSettings:
    """What the chunking rules read: the option, the schedule's other options, and the model config."""

    chunks: int
    overlap: bool
    edge_pairing: bool
    pipeline_size: int
    config: Any
    micro_batch_size: int | None = None  # known to a launcher; the engine checks each microbatch instead


@dataclass(frozen=True)
class ChunkRule:
    """One requirement of chunked unpaired phases: the field it names, when it is broken, what is wrong, the fix."""

    field: str
    broken: Callable[[ChunkSettings], bool]
    problem: str
    fix: str
    value: Callable[[ChunkSettings], Any]


def _on(s: ChunkSettings) -> bool:
    return s.chunks == 2


CHUNK_RULES: tuple[ChunkRule, ...] = (
    ChunkRule(
        "moe_ep_overlap_chunks",
        lambda s: s.chunks not in CHUNK_CHOICES,
        "must be 1 (off) or 2 (split each microbatch that would run alone in two)",
        "set moe_ep_overlap_chunks to 1 or 2",
        lambda s: s.chunks,
    ),
    ChunkRule(
        "moe_ep_overlap_chunks",
        lambda s: _on(s) and not s.overlap,
        "chunks the phases the EP-overlap schedule leaves unpaired, so it needs that schedule",
        "turn on overlap_moe_expert_parallel_comm, or set moe_ep_overlap_chunks=1",
        lambda s: s.chunks,
    ),
    ChunkRule(
        "pipeline_model_parallel_size",
        lambda s: _on(s) and s.pipeline_size > 1,
        "chunked unpaired phases are built for PP = 1 only",
        "set moe_ep_overlap_chunks=1 with pipeline parallelism",
        lambda s: s.pipeline_size,
    ),
    ChunkRule(
        "edge_pairing",
        lambda s: _on(s) and s.edge_pairing,
        "edge pairing and chunking both pair the step's ends; they cannot both be on",
        "choose one: edge_pairing=False or moe_ep_overlap_chunks=1",
        lambda s: s.edge_pairing,
    ),
    ChunkRule(
        "moe_aux_loss_coeff",
        lambda s: _on(s) and (getattr(s.config, "moe_aux_loss_coeff", 0.0) or 0.0) > 0,
        "a load-balancing loss over half a microbatch is a different loss than over the whole one",
        "set moe_aux_loss_coeff=0, or moe_ep_overlap_chunks=1",
        lambda s: s.config.moe_aux_loss_coeff,
    ),
    ChunkRule(
        "moe_z_loss_coeff",
        lambda s: _on(s) and (getattr(s.config, "moe_z_loss_coeff", None) or 0.0) > 0,
        "the router z-loss is a mean over the microbatch's tokens; over half of them it is a different loss",
        "unset moe_z_loss_coeff, or set moe_ep_overlap_chunks=1",
        lambda s: s.config.moe_z_loss_coeff,
    ),
    ChunkRule(
        "moe_expert_capacity_factor",
        lambda s: _on(s) and getattr(s.config, "moe_expert_capacity_factor", None) is not None,
        "which tokens a capacity drops depends on the whole microbatch",
        "unset moe_expert_capacity_factor (no token dropping), or set moe_ep_overlap_chunks=1",
        lambda s: s.config.moe_expert_capacity_factor,
    ),
    ChunkRule(
        "micro_batch_size",
        lambda s: _on(s) and s.micro_batch_size is not None and s.micro_batch_size < 2,
        "chunks split a microbatch along its sequences, so it needs at least 2",
        "set micro_batch_size >= 2 (e.g. micro_batch_size=2 with half the seq_length keeps the tokens per "
        "microbatch), or moe_ep_overlap_chunks=1",
        lambda s: s.micro_batch_size,
    ),
)


def chunk_problems(settings: ChunkSettings) -> list[str]:
    """Every broken rule, one line each: field, value, what is wrong, the fix."""
    return [
        f"{rule.field}={rule.value(settings)!r}: {rule.problem}; fix: {rule.fix}"
        for rule in CHUNK_RULES
        if rule.broken(settings)
    ]
