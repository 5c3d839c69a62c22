"""Prices a pipelined training step (PP > 1, with virtual stages or the plain 1F1B pipeline): every stage at once.

Contract:
    * Each pipeline rank runs its own schedule program (``program(options, its chunks, N, pipeline_size=P,
      rank=r)``), op by op, on a compute resource and an all-to-all link of its own, charged exactly as
      ``simulate.py`` charges PP = 1. Its chunks hold the layers Megatron-Core places there (``chunk_layers``, an even
      split); the last chunk also the head and loss.
    * P2P: a send arrives ``p2p.latency_s + p2p_bytes / p2p.bandwidth_Bps`` after it is launched, on a link of its
      own (the stages' P2P does not queue behind the all-to-alls). A receive blocks the rank until the transfer has
      arrived; that wait is the pipeline's bubble, reported apart from exposed all-to-all time.
    * Ranks advance a step at a time in dependency order (a step runs once every transfer it receives was sent), as
      ``program.pipeline.simulate`` checks; the step time is the last rank's end, plus ``other_s``.
    * :func:`in_flight` is the most microbatches whose activations a rank holds at once (a forward begun, its
      backward not yet done), read off the same schedule.
    * Not priced here: full recompute's segments (PP = 1 only) and uneven first/last stages.
"""

from dataclasses import dataclass, replace

from ep_overlap_lab.pipeline_layout import chunk_layers
from ep_overlap_lab.planner.simulate import (
    PHASES,
    Link,
    Prediction,
    StepCosts,
    _Sim,
    _UnitCharge,
)
from ep_overlap_lab.program.pipeline import Transfer, pipeline_schedule
from ep_overlap_lab.program.steps import Step, program
from megatron.bridge.training.ep_overlap.options import EPOverlapOptions
from megatron.bridge.training.ep_overlap.program.interpreter import run_ops
from megatron.bridge.training.ep_overlap.program.pipeline import BACKWARD, FORWARD
from megatron.bridge.training.ep_overlap.program.steps import ChunkShape

_RECV, _SEND = "recv", "send"


@dataclass
class PipelinePrediction:
    """One simulated pipelined step: its time, and per pipeline rank what ``simulate`` reports for PP = 1 (its
    ``step_s`` the rank's own end) and the time it waited for a peer (``bubble_s``)."""

    step_s: float
    ranks: list[Prediction]
    bubble_s: list[float]

    @property
    def exposed_total_s(self) -> float:
        """Exposed all-to-all time of the rank that ends last."""
        return max(self.ranks, key=lambda p: p.step_s).exposed_total_s


class _P2P:
    """When each transfer of the step arrives: known once its sender ran the send."""

    def __init__(self, link: Link, nbytes: float):
        self.seconds = link.latency_s + nbytes / link.bandwidth_Bps
        self.arrival: dict[tuple, float] = {}

    def sent(self, transfer: Transfer) -> bool:
        return _key(transfer) in self.arrival


def _key(transfer: Transfer) -> tuple:
    return transfer.kind, transfer.microbatch, transfer.chunk


class _StageCharge(_UnitCharge):
    """A unit's runner on one chunk of a pipeline rank: its ends' P2P ops charged on top of ``_UnitCharge``'s."""

    def __init__(self, sim: _Sim, costs: StepCosts, key: tuple, shape: ChunkShape, delay_wgrad: bool, p2p: _P2P):
        super().__init__(sim, costs, key, shape, delay_wgrad)
        self.p2p, self.bubble_s = p2p, 0.0
        self.transfers: dict[tuple[str, str], Transfer] = {}  # this step's, by (recv/send, kind)

    def _receive(self, kind: str) -> None:
        arrival = self.p2p.arrival[_key(self.transfers[(_RECV, kind)])]
        if arrival > self.sim.host:
            self.bubble_s += arrival - self.sim.host
            self.sim.idle_until(arrival)

    def _send(self, kind: str) -> None:
        self.p2p.arrival[_key(self.transfers[(_SEND, kind)])] = self.sim.host + self.p2p.seconds

    def wait_recv_activation(self) -> None:
        self._receive(FORWARD)

    def launch_send_activation(self, x=None) -> None:
        self._send(FORWARD)

    def wait_recv_grad(self) -> None:
        self._receive(BACKWARD)

    def launch_send_grad(self, g=None) -> None:
        self._send(BACKWARD)


class _Rank:
    """One pipeline rank: its program, its resources, and its runners (one per unit, chunk and delay setting)."""

    def __init__(self, steps: list[Step], chunks: list[tuple[ChunkShape, StepCosts]], link: Link, p2p: _P2P, options):
        self.steps, self.chunks, self.p2p, self.position = steps, chunks, p2p, 0
        self.sim = _Sim(link, launch_off_host=options.overlap and options.launch_off_host is True)
        self.runners: dict[tuple, _StageCharge] = {}

    def ready(self) -> bool:
        return all(self.p2p.sent(t) for t in self.steps[self.position].recv)

    def run_step(self) -> None:
        step = self.steps[self.position]
        self.position += 1
        self.sim.phase = step.phase
        self.sim.exposed.setdefault(step.phase, 0.0)
        runners = {}
        for m in step.units:
            shape, costs = self.chunks[m.virtual]
            key = (m.unit, m.virtual, step.delay_wgrad)
            if key not in self.runners:
                unit_costs = costs if m.half is None else costs.scaled(0.5)
                self.runners[key] = _StageCharge(self.sim, unit_costs, key[:2], shape, step.delay_wgrad, self.p2p)
            runners[m.unit] = self.runners[key]
        for direction, transfers in ((_RECV, step.recv), (_SEND, step.send)):
            for t in transfers:
                runners[step.unit_for(t).unit].transfers[(direction, t.kind)] = t
        run_ops(step.ops, runners)

    def prediction(self) -> tuple[Prediction, float]:
        sim = self.sim
        sim.drain()
        exposed = {phase: sim.exposed.get(phase, 0.0) for phase in PHASES if phase in sim.exposed}
        bubble = sum(r.bubble_s for r in self.runners.values())
        return Prediction(step_s=sim.host, compute_s=sim.compute_s, comm_s=sim.comm_s, exposed_s=exposed), bubble


def _rank_chunks(costs: StepCosts, pipeline_size: int, virtual_size: int, rank: int):
    """(shape, costs) of each chunk rank ``rank`` holds, in virtual-stage order."""
    layers = chunk_layers(len(costs.layers), pipeline_size, virtual_size)
    last = len(layers) - 1
    out = []
    for c in range(rank, len(layers), pipeline_size):
        mine = tuple(costs.layers[i] for i in layers[c])
        shape = ChunkShape(c == 0, c == last, tuple(layer.dispatch_bytes > 0 for layer in mine))
        out.append((shape, replace(costs, layers=mine, f_tail=costs.f_tail if c == last else 0.0,
                                   b_head=costs.b_head if c == last else 0.0, segments=())))  # fmt: skip
    return out


def simulate_pipeline(
    costs: StepCosts,
    link: Link,
    num_microbatches: int,
    options: EPOverlapOptions,
    *,
    pipeline_size: int,
    virtual_size: int = 1,
    p2p: Link | None = None,
    p2p_bytes: float = 0.0,
) -> PipelinePrediction:
    """One step of the whole pipeline (see the module docstring); ``p2p`` defaults to ``link``.

    Raises:
        ValueError: Full recompute's segments (priced at PP = 1 only), or layers that do not split evenly.
    """
    if costs.segments:
        raise ValueError("the planner prices full recompute at PP = 1 only; give costs without segments")
    transfers = _P2P(p2p or link, p2p_bytes)
    ranks = []
    for r in range(pipeline_size):
        chunks = _rank_chunks(costs, pipeline_size, virtual_size, r)
        steps = list(program(options, [shape for shape, _ in chunks], num_microbatches, pipeline_size=pipeline_size,
                             rank=r))  # fmt: skip
        ranks.append(_Rank(steps, chunks, link, transfers, options))
    while any(rank.position < len(rank.steps) for rank in ranks):
        progressed = False
        for rank in ranks:
            while rank.position < len(rank.steps) and rank.ready():
                rank.run_step()
                progressed = True
        if not progressed:  # pipeline_schedule's own check (program.pipeline.simulate) rules this out
            raise RuntimeError("the pipeline programs deadlock")
    results = [rank.prediction() for rank in ranks]
    step_s = max(p.step_s for p, _ in results) + costs.other_s
    return PipelinePrediction(step_s, [p for p, _ in results], [b for _, b in results])


def in_flight(pipeline_size: int, virtual_size: int, num_microbatches: int, rank: int, overlap: bool) -> int:
    """The most microbatches whose activations rank ``rank`` holds at once (on all its chunks together)."""
    held = most = 0
    for s in pipeline_schedule(pipeline_size, virtual_size, num_microbatches, rank, overlap=overlap):
        for forward in (s.forward, s.partner if s.forward else None):
            if forward is not None and forward[1] == 0:  # a microbatch enters the rank at its first chunk
                held += 1
        most = max(most, held)
        for backward in (s.backward, s.partner if s.backward else None):
            if backward is not None and backward[1] == 0:  # and leaves it after its first chunk's backward
                held -= 1
    return most
