"""Predicts a training step with and without EP overlap: a discrete-event simulation of the engine's schedule.

Contract:
    * The simulated order is the engine's: :func:`~megatron.bridge.training.ep_overlap.pipeline.schedule_actions`
      (F(0); F(i+1) with B(i); B(N-1); with the engine's edge pairing: F(0) with F(1); F(i+2) paired with B(i);
      B(N-2) with B(N-1); with chunking, the same over the halves of the first and last microbatch, each half
      at half the costs), each paired step expanded layer by layer into ``layer_step``'s four
      windows in its host order, the edge steps as ``forward_pair_step``/``backward_pair_step`` interleave them,
      and the unpaired forward/backward of the plain path. ``simulate`` also returns the
      order in which it launched the all-to-alls, which a test compares with what the engine recorded.
    * One rank is simulated (EP ranks are symmetric): a compute resource that runs its ops in host order, each once
      its inputs have arrived (the time it waits is exposed comm), and one FIFO link. An all-to-all occupies the
      link for ``bytes / bandwidth`` (bytes: the larger of what the rank sends and receives) and arrives
      ``latency`` later; it starts when launched and the link is free. The split-size exchange before each dispatch
      is a round trip queued behind whatever the link still carries: blocking, except in a paired step, where it
      goes out right after F's routing and is waited for only after B's previous attention wgrad (as the engine
      does). With ``launch_off_host`` (the engine's CPU lane, ``lanes.py``) no split-size exchange of the
      overlapped schedule blocks the host: the dispatch starts once the sizes are back and the link is free, while
      the host computes on. One rank is simulated, so it cannot show skew between ranks, which is what both
      changes hide most.
    * Costs are per layer and microbatch (:class:`StepCosts`): the compute segments between all-to-alls, which are
      exactly what the plain path records (``plain dispatch`` of layer j: everything since the previous all-to-all,
      up to layer j's dispatch), the bytes of each all-to-all, and the split-size round trip (which the plain path
      records as ``split_exchange``, on an idle link). They come from a measured step
      (:func:`costs_from_records`) or from a model shape and a hardware profile (``cost_model.py``). Work outside the
      schedule (gradient sync, optimizer) is ``other_s`` and is the same in both arms.
    * Outputs: step time, compute, comm and exposed comm per phase for the plain path and the overlapped one, the
      speedup and the hidden fraction h = (T_plain - T_overlap) / min(T_compute, T_comm); :func:`best_plan` searches
      the microbatch count and delayed wgrad.
"""

import statistics
from collections import defaultdict
from dataclasses import dataclass, field, replace

from megatron.bridge.training.ep_overlap.chunking import units
from megatron.bridge.training.ep_overlap.pipeline import schedule_actions
from megatron.bridge.training.ep_overlap.records import uncovered
from megatron.bridge.training.ep_overlap.wgrad import WGRAD_WINDOWS

PHASES = ("warmup", "paired", "cooldown", "plain")


@dataclass(frozen=True)
class LayerCosts:
    """One layer for one microbatch on one rank: seconds of compute, bytes of each all-to-all (0 for dense).

    Attributes:
        f_pre: Forward from the previous all-to-all to this layer's dispatch: the previous layer's unpermute and
            residual (the embedding for the first), attention, router, permute.
        f_exp: Forward experts, between dispatch and combine.
        b_exp: Expert backward, dgrad and wgrad.
        b_pre: Backward from this layer's dispatch backward to the next all-to-all below: attention/router
            backward, and the combine backward of the layer below (the embedding backward for the first).
        dispatch_bytes: Bytes of the dispatch all-to-all (and of its backward).
        combine_bytes: Bytes of the combine all-to-all (and of its backward).
        expert_wgrad_share: Part of ``b_exp`` that is weight gradient (deferrable with delayed wgrad).
        attention_wgrad_share: Part of ``b_pre`` that is attention weight gradient (deferrable).
    """

    f_pre: float
    f_exp: float
    b_exp: float
    b_pre: float
    dispatch_bytes: float = 0.0
    combine_bytes: float = 0.0
    expert_wgrad_share: float = 0.5  # dgrad and wgrad of a GEMM cost the same FLOPs
    attention_wgrad_share: float = 0.3  # of attention/router/norm backward, about a third is projection wgrad


@dataclass(frozen=True)
class StepCosts:
    """Costs of one microbatch through the whole model, plus what a step adds outside the schedule."""

    layers: tuple[LayerCosts, ...]
    f_tail: float  # after the last combine: its unpermute, final norm, head and loss
    b_head: float  # loss and head backward, and the last layer's unpermute backward
    other_s: float = 0.0  # per step: gradient sync, optimizer

    def scaled(self, share: float) -> "StepCosts":
        """``share`` of the microbatch's tokens: compute and bytes scale with it, ``other_s`` does not."""
        return StepCosts(
            layers=tuple(
                replace(
                    layer,
                    f_pre=layer.f_pre * share,
                    f_exp=layer.f_exp * share,
                    b_exp=layer.b_exp * share,
                    b_pre=layer.b_pre * share,
                    dispatch_bytes=layer.dispatch_bytes * share,
                    combine_bytes=layer.combine_bytes * share,
                )
                for layer in self.layers
            ),
            f_tail=self.f_tail * share,
            b_head=self.b_head * share,
            other_s=self.other_s,
        )


@dataclass(frozen=True)
class Link:
    """One rank's link: bandwidth in bytes/s, latency per all-to-all, and the split-size round trip."""

    bandwidth_Bps: float
    latency_s: float = 0.0
    meta_s: float = 0.0


@dataclass
class Prediction:
    """One simulated step."""

    step_s: float
    compute_s: float
    comm_s: float
    exposed_s: dict[str, float] = field(default_factory=dict)
    launches: list[tuple[str, int, int]] = field(default_factory=list)  # (op, layer, microbatch), in order

    @property
    def exposed_total_s(self) -> float:
        return sum(self.exposed_s.values())


class _Sim:
    """The compute resource (host order) and the FIFO link of one rank."""

    def __init__(self, link: Link, launch_off_host: bool = False):
        self.link, self.launch_off_host = link, launch_off_host
        self.host = self.link_free = 0.0
        self.arrived: dict[tuple[str, int, int], float] = {}
        self.phase = "plain"
        self.exposed: dict[str, float] = defaultdict(float)
        self.compute_s = self.comm_s = 0.0
        self.launches: list[tuple[str, int, int]] = []

    def _wait_until(self, t: float) -> None:
        if t > self.host:
            self.exposed[self.phase] += t - self.host
            self.host = t

    def compute(self, seconds: float, after: tuple[str, int, int] | None = None) -> None:
        if after is not None:
            self._wait_until(self.arrived[after])
        self.host += seconds
        self.compute_s += seconds

    def exchange_start(self, nbytes: float) -> float | None:
        """Sends the split sizes of a dispatch of ``nbytes``: they are back one round trip after the bytes still
        queued on the link. Returns when (None for a dense layer, which exchanges nothing)."""
        if nbytes <= 0:
            return None
        self.comm_s += self.link.meta_s
        return max(self.host, self.link_free) + self.link.meta_s

    def exchange_wait(self, arrival: float | None) -> None:
        if arrival is not None:
            self._wait_until(arrival)

    def launch(
        self,
        key: tuple[str, int, int],
        nbytes: float,
        *,
        split_exchange: bool = False,
        not_before: float | None = None,
    ) -> None:
        """An all-to-all of ``nbytes`` (after its split-size exchange, unless that ran before; off the host, not
        before ``not_before``)."""
        if split_exchange:
            not_before = self.exchange_start(nbytes)
            if not self.launch_off_host:
                self.exchange_wait(not_before)
        if nbytes <= 0:  # a dense layer: nothing crosses the link
            self.arrived[key] = self.host
            return
        link = self.link
        start = max(self.host, self.link_free, not_before or 0.0)
        self.link_free = start + nbytes / link.bandwidth_Bps
        self.arrived[key] = self.link_free + link.latency_s
        self.comm_s += self.arrived[key] - start
        self.launches.append(key)


def _forward(sim: _Sim, costs: StepCosts, mb: int) -> None:
    previous = None
    for j, layer in enumerate(costs.layers):
        sim.compute(layer.f_pre, previous)
        sim.launch(("dispatch", j, mb), layer.dispatch_bytes, split_exchange=True)
        sim.compute(layer.f_exp, ("dispatch", j, mb))
        sim.launch(("combine", j, mb), layer.combine_bytes)
        previous = ("combine", j, mb)
    sim.compute(costs.f_tail, previous)


def _backward(sim: _Sim, costs: StepCosts, mb: int, delay_wgrad: bool) -> None:
    sim.compute(costs.b_head)
    for k in reversed(range(len(costs.layers))):
        layer = costs.layers[k]
        expert_wgrad, attention_wgrad = _wgrads(layer, delay_wgrad)
        sim.launch(("combine_bwd", k, mb), layer.combine_bytes)
        sim.compute(layer.b_exp - expert_wgrad, ("combine_bwd", k, mb))
        sim.launch(("dispatch_bwd", k, mb), layer.dispatch_bytes)
        sim.compute(expert_wgrad)
        sim.compute(layer.b_pre - attention_wgrad, ("dispatch_bwd", k, mb))
        sim.compute(attention_wgrad)


Side = list[tuple[int, StepCosts]]  # one microbatch in a step: (unit, costs) for it whole, or for each half


def _forward_pair(sim: _Sim, pair: Side) -> None:
    """``forward_pair_step``: two forwards interleaved, each one's all-to-alls beside the other's compute."""
    previous: dict[int, tuple[str, int, int] | None] = {u: None for u, _ in pair}
    for j in range(len(pair[0][1].layers)):
        for u, costs in pair:
            sim.compute(costs.layers[j].f_pre, previous[u])
            sim.launch(("dispatch", j, u), costs.layers[j].dispatch_bytes, split_exchange=True)
        for u, costs in pair:
            sim.compute(costs.layers[j].f_exp, ("dispatch", j, u))
            sim.launch(("combine", j, u), costs.layers[j].combine_bytes)
            previous[u] = ("combine", j, u)
    for u, costs in pair:
        sim.compute(costs.f_tail, previous[u])


def _wgrads(layer: LayerCosts, delay_wgrad: bool) -> tuple[float, float]:
    """(expert wgrad, attention wgrad) of a layer's backward that delayed wgrad defers (0 without it)."""
    if not delay_wgrad:
        return 0.0, 0.0
    return layer.b_exp * layer.expert_wgrad_share, layer.b_pre * layer.attention_wgrad_share


def _backward_pair(sim: _Sim, pair: Side, delay_wgrad: bool) -> None:
    """``backward_pair_step``: two backwards interleaved, A's part of each layer before B's."""
    (a, _), (b, _) = pair
    sim.compute(sum(costs.b_head for _, costs in pair))
    attention_wgrads = 0.0
    for k in reversed(range(len(pair[0][1].layers))):
        layer = {u: costs.layers[k] for u, costs in pair}
        wgrads = {u: _wgrads(layer[u], delay_wgrad) for u in layer}
        sim.launch(("combine_bwd", k, a), layer[a].combine_bytes)
        sim.compute(attention_wgrads)
        sim.launch(("combine_bwd", k, b), layer[b].combine_bytes)
        for u in (a, b):
            sim.compute(layer[u].b_exp - wgrads[u][0], ("combine_bwd", k, u))
            sim.launch(("dispatch_bwd", k, u), layer[u].dispatch_bytes)
            sim.compute(wgrads[u][0])
        for u in (a, b):
            sim.compute(layer[u].b_pre - wgrads[u][1], ("dispatch_bwd", k, u))
        attention_wgrads = wgrads[a][1] + wgrads[b][1]
    sim.compute(attention_wgrads)


def _paired(sim: _Sim, f: Side, b: Side, delay_wgrad: bool, wgrad_window: int) -> None:
    """``paired_microbatch_step``: head backward of B, then F layer j with B layer L-1-j, window by window. A
    chunked microbatch's side has two halves, and each of its nodes runs on the first half, then the second."""
    num = len(f[0][1].layers)
    sim.compute(sum(costs.b_head for _, costs in b))
    previous_attention_wgrad = 0.0
    for j in range(num):
        k = num - 1 - j
        wgrads = {u: _wgrads(costs.layers[k], delay_wgrad) for u, costs in b}
        # window 1: B.combine backward (comm) || F.pre_dispatch, [B's previous attention wgrad] (compute)
        for u, costs in b:
            sim.launch(("combine_bwd", k, u), costs.layers[k].combine_bytes)
        early = wgrad_window == 1 and f[0][1].layers[j].dispatch_bytes <= 0  # a dense F layer exchanges nothing
        if early:
            sim.compute(previous_attention_wgrad)
        for u, costs in f:
            sim.compute(costs.layers[j].f_pre, ("combine", j - 1, u) if j else None)
        # F's split sizes go out now (every half's before any bulk transfer), back while the wgrad computes
        arrivals = [sim.exchange_start(costs.layers[j].dispatch_bytes) for _, costs in f]
        if wgrad_window == 1 and not early:
            sim.compute(previous_attention_wgrad)
        # window 2: F.dispatch (comm) || [B's previous attention wgrad], B.experts backward, dgrad (compute)
        if not sim.launch_off_host:
            for arrival in arrivals:
                sim.exchange_wait(arrival)
        for arrival, (u, costs) in zip(arrivals, f):
            sim.launch(("dispatch", j, u), costs.layers[j].dispatch_bytes, not_before=arrival)
        if wgrad_window == 2:
            sim.compute(previous_attention_wgrad)
        for u, costs in b:
            sim.compute(costs.layers[k].b_exp - wgrads[u][0], ("combine_bwd", k, u))
        # window 3: B.dispatch backward (comm) || B.experts wgrad, F.experts (compute)
        for u, costs in b:
            sim.launch(("dispatch_bwd", k, u), costs.layers[k].dispatch_bytes)
        for u, _ in b:
            sim.compute(wgrads[u][0])
        for u, costs in f:
            sim.compute(costs.layers[j].f_exp, ("dispatch", j, u))
        # window 4: F.combine (comm) || B.pre_dispatch backward, dgrad (compute)
        for u, costs in f:
            sim.launch(("combine", j, u), costs.layers[j].combine_bytes)
        for u, costs in b:
            sim.compute(costs.layers[k].b_pre - wgrads[u][1], ("dispatch_bwd", k, u))
        previous_attention_wgrad = sum(wgrads[u][1] for u, _ in b)
    sim.compute(previous_attention_wgrad)
    for u, costs in f:
        sim.compute(costs.f_tail, ("combine", num - 1, u))


def simulate(
    costs: StepCosts,
    link: Link,
    num_microbatches: int,
    *,
    overlap: bool,
    delay_wgrad: bool = False,
    wgrad_window: int = 1,
    edge_pairing: bool = False,
    chunks: int = 1,
    launch_off_host: bool = False,
) -> Prediction:
    """One step of ``num_microbatches`` microbatches, plain (``overlap=False``) or with the paired schedule.

    ``wgrad_window`` places the delayed attention wgrad as the engine's ``attention_wgrad_window`` does;
    ``edge_pairing`` pairs the warm-up's and the cool-down's two microbatches as the engine's option does;
    ``chunks=2`` splits the microbatches that would run alone as ``moe_ep_overlap_chunks`` does (each half costs
    half of the microbatch's compute and bytes; latencies stay per all-to-all); ``launch_off_host``: the
    overlapped schedule's dispatches wait for their split sizes off the host, as on the engine's CPU lane.
    """
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}")
    sim = _Sim(link, launch_off_host=overlap and launch_off_host)
    if not overlap:
        sim.exposed["plain"] = 0.0
        for mb in range(num_microbatches):
            _forward(sim, costs, mb)
            _backward(sim, costs, mb, delay_wgrad=False)
    else:
        sides: dict[int, Side] = defaultdict(list)
        for u, unit in enumerate(units(num_microbatches, chunks)):
            sides[unit.microbatch].append((u, costs if unit.half is None else costs.scaled(0.5)))
        for action in schedule_actions(num_microbatches, edge_pairing):
            sim.phase = action.phase
            sim.exposed.setdefault(action.phase, 0.0)
            f = sides[action.forward] if action.forward is not None else None
            b = sides[action.backward] if action.backward is not None else None
            partner = sides[action.partner] if action.partner is not None else None
            if f is not None and b is not None:
                _paired(sim, f, b, delay_wgrad, wgrad_window)
            elif f is not None and (partner is not None or len(f) == 2):  # edge pairing, or a chunk's halves
                _forward_pair(sim, f + (partner or []))
            elif b is not None and (partner is not None or len(b) == 2):
                _backward_pair(sim, b + (partner or []), delay_wgrad)
            elif f is not None:
                _forward(sim, f[0][1], f[0][0])
            else:
                _backward(sim, b[0][1], b[0][0], delay_wgrad)
    return Prediction(
        step_s=sim.host + costs.other_s,
        compute_s=sim.compute_s,
        comm_s=sim.comm_s,
        exposed_s={phase: sim.exposed.get(phase, 0.0) for phase in PHASES if phase in sim.exposed},
        launches=sim.launches,
    )


@dataclass
class Comparison:
    """The plain path and the overlapped one for the same costs."""

    baseline: Prediction
    overlap: Prediction
    num_microbatches: int
    delay_wgrad: bool
    wgrad_window: int = 1

    @property
    def speedup(self) -> float:
        return self.baseline.step_s / self.overlap.step_s

    @property
    def h(self) -> float:
        """Hidden fraction of the hideable time: (T_plain - T_overlap) / min(T_compute, T_comm)."""
        comm = self.baseline.exposed_total_s
        compute = self.baseline.step_s - comm
        hideable = min(compute, comm)
        return 0.0 if hideable <= 0 else (self.baseline.step_s - self.overlap.step_s) / hideable


def predict(
    costs: StepCosts,
    link: Link,
    num_microbatches: int,
    delay_wgrad: bool = False,
    wgrad_window: int = 1,
    edge_pairing: bool = False,
    chunks: int = 1,
    launch_off_host: bool = False,
) -> Comparison:
    """Plain vs overlapped step for one microbatch count (and, with delayed wgrad, one attention-wgrad window)."""
    overlapped = simulate(
        costs,
        link,
        num_microbatches,
        overlap=True,
        delay_wgrad=delay_wgrad,
        wgrad_window=wgrad_window,
        edge_pairing=edge_pairing,
        chunks=chunks,
        launch_off_host=launch_off_host,
    )
    return Comparison(
        simulate(costs, link, num_microbatches, overlap=False),
        overlapped,
        num_microbatches,
        delay_wgrad,
        wgrad_window,
    )


def step_by_wgrad_window(
    costs: StepCosts,
    link: Link,
    num_microbatches: int,
    *,
    edge_pairing: bool = False,
    chunks: int = 1,
    launch_off_host: bool = False,
) -> dict[int, float]:
    """The overlapped step with delayed wgrad for each attention-wgrad window (what the engine's auto placement
    compares)."""
    return {
        window: simulate(
            costs,
            link,
            num_microbatches,
            overlap=True,
            delay_wgrad=True,
            wgrad_window=window,
            edge_pairing=edge_pairing,
            chunks=chunks,
            launch_off_host=launch_off_host,
        ).step_s
        for window in WGRAD_WINDOWS
    }


def best_plan(costs: StepCosts, link: Link, microbatch_counts: list[int]) -> list[Comparison]:
    """Every (microbatch count, delayed wgrad, attention-wgrad window) option, best throughput gain first.

    The options differ in how many microbatches a step holds, so they are ranked by time per microbatch of the
    overlapped step; ties keep the plainer option (fewer microbatches, no delayed wgrad, window 1).
    """
    options = [predict(costs, link, n) for n in microbatch_counts]
    options += [predict(costs, link, n, True, window) for n in microbatch_counts for window in WGRAD_WINDOWS]
    return sorted(
        options,
        key=lambda c: (c.overlap.step_s / c.num_microbatches, c.num_microbatches, c.delay_wgrad, c.wgrad_window),
    )


# ---------------------------------------------------------------------------------------------------------------
# Costs from a measured step


def costs_from_records(
    steps: list[dict], step_times_s: list[float], link_gbps: float | None, num_layers: int
) -> tuple[StepCosts, Link]:
    """Costs from the plain path's records of one rank (the harness's baseline arm, ``records[rank]``).

    Args:
        steps: Per step, ``{"comm": [...], "compute": [...]}`` as the harness records them.
        step_times_s: The measured time of the same steps (for ``other_s``: what a step spends outside the schedule).
        link_gbps: The link's rate when known (an emulated link); without it the bandwidth is fitted to the
            all-to-alls' durations with no latency.
        num_layers: Layers of the model (dense ones have no all-to-all; their compute lies in the neighbouring
            segments, as the plain path records it).
    """
    compute: dict[tuple[str, int], list[float]] = defaultdict(list)
    comm: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)  # (bytes, seconds)
    other = []
    for step, total in zip(steps, step_times_s):
        for r in step["compute"]:
            compute[(r["node"], r["layer"])].append(r["end_s"] - r["start_s"])
        for r in step["comm"]:
            comm[(r["op"], r["layer"])].append((max(r["bytes_sent"], r["bytes_received"]), r["end_s"] - r["start_s"]))
        ends = [r["end_s"] for r in step["compute"]] + [r["end_s"] for r in step["comm"]]
        other.append(max(0.0, total - max(ends)))
    # The plain path records one segment per (node, layer) and microbatch: medians are per-microbatch costs.
    med = {key: statistics.median(values) for key, values in compute.items()}
    meta = [t for (op, _), values in comm.items() if op == "split_exchange" for _, t in values]
    comm = {key: values for key, values in comm.items() if key[0] != "split_exchange"}
    moe = sorted({layer for _, layer in comm})

    def seg(node: str, layer: int) -> float:
        return med.get((node, layer), 0.0)

    def nbytes(op: str, layer: int) -> float:
        return statistics.median(b for b, _ in comm[(op, layer)]) if (op, layer) in comm else 0.0

    layers = []
    for j in range(num_layers):
        below = [m for m in moe if m < j]
        layers.append(
            LayerCosts(
                # up to the split-size exchange, and from it to the dispatch
                f_pre=seg("plain split_exchange", j) + seg("plain dispatch", j),
                f_exp=seg("plain combine", j),
                b_exp=seg("plain dispatch_bwd", j),
                # from this layer's dispatch backward to the next all-to-all below (or the end of backward)
                b_pre=seg("plain combine_bwd", below[-1]) if below else seg("plain backward_end", -1),
                dispatch_bytes=nbytes("dispatch", j),
                combine_bytes=nbytes("combine", j),
            )
            if j in moe
            else LayerCosts(0.0, 0.0, 0.0, 0.0)
        )
    costs = StepCosts(
        layers=tuple(layers),
        f_tail=seg("plain forward_end", -1),
        b_head=seg("plain combine_bwd", moe[-1]) if moe else 0.0,
        other_s=statistics.median(other),
    )
    samples = [sample for values in comm.values() for sample in values]
    if link_gbps:
        bandwidth = link_gbps * 1e9 / 8
        latency = max(0.0, statistics.median(t - b / bandwidth for b, t in samples)) if samples else 0.0
    else:
        bandwidth = sum(b for b, _ in samples) / max(sum(t for _, t in samples), 1e-12) if samples else 1e12
        latency = 0.0
    return costs, Link(bandwidth_Bps=bandwidth, latency_s=latency, meta_s=statistics.median(meta) if meta else 0.0)


def comm_kind(op: str) -> str:
    """``p2p`` for pipeline transfers, ``all-to-all`` for the EP dispatch/combine (and their backward)."""
    return "p2p" if op.startswith("p2p") else "all-to-all"


def exposed_by_phase_and_kind(step: dict) -> dict[str, dict[str, float]]:
    """One recorded step of one rank: per phase, the time each kind of communication was on the critical path, as
    ``{phase: {kind: seconds}}``. P2P counts where the host waited on it and nothing computed; all-to-all where
    it was in flight and the host neither computed nor waited on P2P (so the kinds add up to the total)."""
    compute = [(r["start_s"], r["end_s"]) for r in step["compute"]]
    p2p = [(r["start_s"], r["end_s"]) for r in step["comm"] if comm_kind(r["op"]) == "p2p"]
    grouped: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for r in step["comm"]:
        grouped[(r["phase"], comm_kind(r["op"]))].append((r["start_s"], r["end_s"]))
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for (phase, kind), intervals in grouped.items():
        out[phase][kind] = uncovered(intervals, compute if kind == "p2p" else compute + p2p)
    return dict(out)


def exposed_by_phase(step: dict) -> dict[str, float]:
    """Measured exposed comm per phase of one recorded step: communication time that no compute covered."""
    return {phase: sum(kinds.values()) for phase, kinds in exposed_by_phase_and_kind(step).items()}
