"""Predicts a training step with and without EP overlap: prices the engine's own schedule program.

Contract:
    * The simulated order is the engine's: the steps :func:`~ep_overlap_lab.program.steps.program`
      yields for PP = 1 and the given :class:`~megatron.bridge.training.ep_overlap.options.EPOverlapOptions`, op by
      op. Each op is charged a cost by its runner (:class:`_UnitCharge`, :class:`_LayerCharge`), in the loop that
      runs the engine's nodes (``program.interpreter.run_ops``); a chunked microbatch's halves cost half of its
      compute and bytes each. ``simulate`` also returns the order in which it launched the all-to-alls, which a
      test compares with what the engine recorded.
    * One rank is simulated (EP ranks are symmetric): a compute resource that runs its ops in host order, a ``wait``
      blocking it until that all-to-all has arrived (the time it waits is exposed comm), and one FIFO link. An
      all-to-all occupies the link for ``bytes / bandwidth`` (bytes: the larger of what the rank sends and receives)
      and arrives ``latency`` later; it starts when launched and the link is free. A split-size exchange is a round
      trip queued behind whatever the link still carries. With ``launch_off_host=True`` (the engine's CPU lane)
      no split-size wait blocks the host of the overlapped schedule: the dispatch starts once the sizes are back and
      the link is free. One rank is simulated, so it cannot show skew between ranks.
    * Costs are per layer and microbatch (:class:`StepCosts`): the compute segments between all-to-alls, which are
      exactly what the plain path records (``plain dispatch`` of layer j: everything since the previous all-to-all,
      up to layer j's dispatch), so a compute op that ends no segment (an embedding, an unpermute) costs nothing of
      its own; the bytes of each all-to-all; and the split-size round trip. They come from a measured step
      (``measured.costs_from_records``) or from a model shape and a hardware profile (``cost_model.py``). Work
      outside the schedule (gradient sync, optimizer) is ``other_s`` and is the same in both arms.
    * Outputs: step time, compute, comm and exposed comm per phase for the plain path and the overlapped one, the
      speedup and the hidden fraction h = (T_plain - T_overlap) / min(T_compute, T_comm); :func:`best_choice` searches
      the microbatch count and delayed wgrad.
"""

import math
from dataclasses import dataclass, field, replace

from ep_overlap_lab.planner.resources import Resources
from ep_overlap_lab.program.runners import NoPipeline
from ep_overlap_lab.program.steps import program
from megatron.bridge.training.ep_overlap.options import WGRAD_WINDOWS, EPOverlapOptions
from megatron.bridge.training.ep_overlap.program.interpreter import run_ops
from megatron.bridge.training.ep_overlap.program.pipeline import BACKWARD, FORWARD, Phase
from megatron.bridge.training.ep_overlap.program.steps import ChunkShape, unit_ops

PHASES = (Phase.WARMUP, Phase.PAIRED, Phase.COOLDOWN, Phase.PLAIN)
DEFAULT_OPTIONS = EPOverlapOptions()  # overlap on, nothing else


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
    # Full recompute's segments (``contract.segment_of``): each replays its layers' forward (their f_pre and f_exp, and
    # their all-to-alls) before its last layer's backward
    segments: tuple[tuple[int, int], ...] = ()

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
            segments=self.segments,
        )


def _finite(value, least: float, strictly: bool = False) -> bool:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return ok and (value > least if strictly else value >= least)


@dataclass(frozen=True)
class Link:
    """One rank's link: bandwidth in bytes/s, latency per all-to-all, and the split-size round trip.

    Raises:
        ValueError: A bandwidth that is not a finite number above 0, or a latency that is negative or not finite.
    """

    bandwidth_Bps: float
    latency_s: float = 0.0
    meta_s: float = 0.0
    # Contention (planner/resources.py): how much slower a transfer runs beside compute, and compute beside a transfer
    comm_stretch: float = 1.0
    compute_stretch: float = 1.0

    def __post_init__(self):
        if not _finite(self.bandwidth_Bps, 0.0, strictly=True):
            raise ValueError(f"Link: bandwidth_Bps={self.bandwidth_Bps!r}; give a finite number of bytes/s above 0")
        for name in ("latency_s", "meta_s"):
            if not _finite(getattr(self, name), 0.0):
                raise ValueError(f"Link: {name}={getattr(self, name)!r}; give a finite number of seconds, 0 or more")
        for name in ("comm_stretch", "compute_stretch"):
            if not _finite(getattr(self, name), 1.0):
                raise ValueError(f"Link: {name}={getattr(self, name)!r}; give a finite factor of 1 or more")


@dataclass
class Prediction:
    """One simulated step."""

    step_s: float
    compute_s: float
    comm_s: float
    exposed_s: dict[str, float] = field(default_factory=dict)
    launches: list[tuple[str, int, int]] = field(default_factory=list)  # (op, layer, microbatch), in order
    steady_from: int | None = None  # priced from this many microbatches' steady state (no launches then)

    @property
    def exposed_total_s(self) -> float:
        return sum(self.exposed_s.values())


_Sim = Resources  # the name pipeline.py and the runners know


class _LayerCharge:
    """What each op at one layer of one unit costs the rank: the interpreter's runner for that layer."""

    def __init__(self, sim: _Sim, layer: LayerCosts, unit: int, index: int, delay_wgrad: bool):
        self.sim, self.costs, self.key = sim, layer, (unit, index)
        # The weight-gradient parts delayed wgrad moves out of the backward (none without it).
        self.expert_wgrad = layer.b_exp * layer.expert_wgrad_share if delay_wgrad else 0.0
        self.attention_wgrad = layer.b_pre * layer.attention_wgrad_share if delay_wgrad else 0.0

    def _launch(self, name: str, nbytes: float, exchange=None) -> None:
        unit, index = self.key
        self.sim.launch((name, index, unit), nbytes, exchange)

    def _wait(self, name: str) -> None:
        unit, index = self.key
        self.sim.wait_for((name, index, unit))

    # forward: each compute op that ends a segment of the plain path costs that segment; the others nothing
    def compute_pre_dispatch(self, x) -> None:
        self.sim.compute(self.costs.f_pre)

    def launch_split(self) -> None:
        self.sim.exchange_start(self.key, self.costs.dispatch_bytes)

    def wait_split(self) -> None:
        if not self.sim.launch_off_host and self.sim.has_exchange(self.key):
            self.sim.wait_exchange(self.key)

    def launch_dispatch(self) -> None:
        self._launch("dispatch", self.costs.dispatch_bytes, self.key if self.sim.has_exchange(self.key) else None)

    def wait_dispatch(self) -> None:
        self._wait("dispatch")

    def compute_experts(self) -> None:
        self.sim.compute(self.costs.f_exp)

    def launch_combine(self) -> None:
        self._launch("combine", self.costs.combine_bytes)

    def wait_combine(self) -> None:
        self._wait("combine")

    def compute_combine(self) -> None:
        """Unpermute and residual add: part of the next segment."""

    # backward
    def compute_combine_bwd(self, g) -> None:
        """Part of the segment that ends at the next all-to-all."""

    def launch_combine_bwd(self) -> None:
        self._launch("combine_bwd", self.costs.combine_bytes)

    def wait_combine_bwd(self) -> None:
        self._wait("combine_bwd")

    def compute_experts_bwd(self) -> None:
        self.sim.compute(self.costs.b_exp - self.expert_wgrad)

    def launch_dispatch_bwd(self) -> None:
        self._launch("dispatch_bwd", self.costs.dispatch_bytes)

    def wgrad_experts(self) -> None:
        self.sim.compute(self.expert_wgrad)

    def wait_dispatch_bwd(self) -> None:
        self._wait("dispatch_bwd")

    def compute_pre_dispatch_bwd(self) -> None:
        self.sim.compute(self.costs.b_pre - self.attention_wgrad)

    def wgrad_attention(self) -> None:
        self.sim.compute(self.attention_wgrad)

    # full recompute: the replay costs what the forward did; its split sizes are the forward's (no exchange)
    compute_replay_pre_dispatch, compute_replay_experts = compute_pre_dispatch, compute_experts
    compute_replay_combine = compute_combine

    def compute_replay_input(self) -> None:
        """The segment's kept input: nothing to compute."""

    def launch_replay_dispatch(self) -> None:
        self._launch("replay_dispatch", self.costs.dispatch_bytes)

    def wait_replay_dispatch(self) -> None:
        self._wait("replay_dispatch")

    def launch_replay_combine(self) -> None:
        self._launch("replay_combine", self.costs.combine_bytes)

    def wait_replay_combine(self) -> None:
        self._wait("replay_combine")


class _UnitCharge(NoPipeline):
    """What each op at one unit's chunk ends costs, with its layers' runners: the interpreter's runner for a unit."""

    def __init__(self, sim: _Sim, costs: StepCosts, unit: int, shape: ChunkShape, delay_wgrad: bool):
        self.sim, self.costs, self.unit, self.shape = sim, costs, unit, shape
        self.layers = [_LayerCharge(sim, layer, unit, j, delay_wgrad) for j, layer in enumerate(costs.layers)]

    def compute_embedding(self) -> None:
        """Part of the first layer's forward segment."""

    def compute_head(self, x) -> None:
        self.sim.compute(self.costs.f_tail)

    def compute_head_bwd(self) -> None:
        self.sim.compute(self.costs.b_head)

    def compute_embedding_bwd(self, g) -> None:
        """Part of the first layer's backward segment."""

    def _whole(self, role: str) -> None:
        """A whole chunk by autograd: the unit's ops alone, each all-to-all waited for at once, nothing delayed (a
        plain step never delays wgrad, so this runner is already one that charges none)."""
        run_ops(unit_ops(role, self.unit, self.shape, delay_wgrad=False), {self.unit: self})

    def plain_forward(self) -> None:
        self._whole(FORWARD)

    def plain_backward(self) -> None:
        self._whole(BACKWARD)


# From this many microbatches on, a PP = 1 step only repeats its steady paired step: each more microbatch adds the
# same time (checked on three counts before it is used; tests compare against simulating every op).
STEADY_FROM = 16
# Layers are simulated op by op (about 8 ms per layer and prediction on one core): this bounds a prediction's time.
MAX_LAYERS = 256


def simulate(
    costs: StepCosts, link: Link, num_microbatches: int, options: EPOverlapOptions = DEFAULT_OPTIONS
) -> Prediction:
    """One step of ``num_microbatches`` microbatches as the engine runs it with ``options`` (``overlap=False``: the
    plain path). ``options.launch_off_host`` is whether the lane launches off the host (None counts as not).

    Beyond :data:`STEADY_FROM` microbatches the step is priced in constant time: three counts are simulated op by
    op and, their increments being equal (the steady state), the rest is added per microbatch; ``launches`` is then
    empty and ``steady_from`` says so. Otherwise every op is simulated."""
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}")
    if len(costs.layers) > MAX_LAYERS:
        raise ValueError(
            f"{len(costs.layers)} layers: the planner prices up to {MAX_LAYERS} layers (it simulates every op of "
            "each; the largest published MoE models have under 100); give the layers of one pipeline stage"
        )
    if num_microbatches <= STEADY_FROM + 2:
        return _simulate_ops(costs, link, num_microbatches, options)
    a, b, c = (_simulate_ops(costs, link, n, options) for n in range(STEADY_FROM, STEADY_FROM + 3))
    if not _steady(a, b, c):
        return _simulate_ops(costs, link, num_microbatches, options)
    return _extend(a, b, num_microbatches - STEADY_FROM)


def _fields(p: Prediction) -> dict[str, float]:
    return {"step_s": p.step_s, "compute_s": p.compute_s, "comm_s": p.comm_s} | {
        f"exposed:{k}": v for k, v in p.exposed_s.items()
    }


def _steady(a: Prediction, b: Prediction, c: Prediction) -> bool:
    """Whether b - a == c - b for every figure (to rounding): one more microbatch adds the same each time."""
    fa, fb, fc = _fields(a), _fields(b), _fields(c)
    if not fa.keys() == fb.keys() == fc.keys():
        return False
    return all(abs((fc[k] - fb[k]) - (fb[k] - fa[k])) <= 1e-9 * max(1.0, abs(fc[k])) for k in fa)


def _extend(a: Prediction, b: Prediction, more: int) -> Prediction:
    """``a`` with ``more`` microbatches added, each adding what ``b`` added to ``a``."""
    step = {k: v + more * (_fields(b)[k] - v) for k, v in _fields(a).items()}
    return Prediction(
        step_s=step["step_s"],
        compute_s=step["compute_s"],
        comm_s=step["comm_s"],
        exposed_s={k.split(":", 1)[1]: v for k, v in step.items() if k.startswith("exposed:")},
        steady_from=STEADY_FROM,
    )


def _simulate_ops(costs: StepCosts, link: Link, num_microbatches: int, options: EPOverlapOptions) -> Prediction:
    """Every op of the step's program, in order."""
    shape = ChunkShape(True, True, tuple(layer.dispatch_bytes > 0 for layer in costs.layers), costs.segments)

    sim = _Sim(link, launch_off_host=options.overlap and options.launch_off_host is True)
    halves = costs.scaled(0.5)  # what each half of a chunked microbatch costs
    runners: dict[tuple[int, bool], _UnitCharge] = {}  # (unit, delay_wgrad): made once, the costs do not change

    def runner(m, delay_wgrad: bool) -> _UnitCharge:
        if (m.unit, delay_wgrad) not in runners:
            unit_costs = costs if m.half is None else halves
            runners[(m.unit, delay_wgrad)] = _UnitCharge(sim, unit_costs, m.unit, shape, delay_wgrad)
        return runners[(m.unit, delay_wgrad)]

    for step in program(options, [shape], num_microbatches):
        sim.phase = step.phase
        sim.exposed.setdefault(step.phase, 0.0)
        run_ops(step.ops, {m.unit: runner(m, step.delay_wgrad) for m in step.units})
    sim.drain()
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
    options: EPOverlapOptions

    @property
    def delay_wgrad(self) -> bool:
        return self.options.delay_wgrad

    @property
    def wgrad_window(self) -> int:
        return self.options.attention_wgrad_window or 1

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
    costs: StepCosts, link: Link, num_microbatches: int, options: EPOverlapOptions = DEFAULT_OPTIONS
) -> Comparison:
    """Plain vs overlapped (with ``options``) step for one microbatch count.

    Raises:
        ValueError: When no layer moves a byte (as at EP 1): there is nothing to overlap, and a speedup computed
            from such costs would only be the dense layers' scheduling.
    """
    if not any(layer.dispatch_bytes > 0 for layer in costs.layers):
        raise ValueError(
            "no layer moves tokens between ranks (every dispatch is 0 bytes, as at expert-parallel size 1): there "
            "is no communication to overlap; price a layout with EP 2 or more"
        )
    overlapped = simulate(costs, link, num_microbatches, replace(options, overlap=True))
    baseline = simulate(costs, link, num_microbatches, EPOverlapOptions(overlap=False))
    return Comparison(baseline, overlapped, num_microbatches, options)


def step_by_wgrad_window(costs: StepCosts, link: Link, num_microbatches: int, options: EPOverlapOptions) -> dict:
    """The overlapped step with delayed wgrad for each attention-wgrad window (what auto placement compares)."""
    return {
        window: simulate(
            costs, link, num_microbatches,
            replace(options, overlap=True, delay_wgrad=True, attention_wgrad_window=window),
        ).step_s
        for window in WGRAD_WINDOWS
    }  # fmt: skip


def best_choice(costs: StepCosts, link: Link, microbatch_counts: list[int]) -> list[Comparison]:
    """Every (microbatch count, delayed wgrad, attention-wgrad window) option, best throughput gain first.

    The options differ in how many microbatches a step holds, so they are ranked by time per microbatch of the
    overlapped step; ties keep the plainer option (fewer microbatches, no delayed wgrad, window 1).
    """
    choices = [EPOverlapOptions()]
    choices += [EPOverlapOptions(delay_wgrad=True, attention_wgrad_window=window) for window in WGRAD_WINDOWS]
    options = [predict(costs, link, n, choice) for n in microbatch_counts for choice in choices]
    return sorted(
        options,
        key=lambda c: (c.overlap.step_s / c.num_microbatches, c.num_microbatches, c.delay_wgrad, c.wgrad_window),
    )
