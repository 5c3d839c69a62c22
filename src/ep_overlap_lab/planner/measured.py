"""The planner's reading of measured steps: per-layer costs from the plain path's records, and exposed comm.

Every function reads the records as the harness writes them (``StepRecorder.as_dict``: seconds from the step
start); none needs torch.
"""

import statistics
from collections import defaultdict

from ep_overlap_lab.planner.simulate import LayerCosts, Link, StepCosts
from ep_overlap_lab.step_stats import uncovered


def costs_from_records(
    steps: list[dict],
    step_times_s: list[float],
    link_gbps: float | None,
    num_layers: int,
    segments: tuple[tuple[int, int], ...] = (),
) -> tuple[StepCosts, Link]:
    """Costs from the plain path's records of one rank (the harness's baseline arm, ``records[rank]``).

    Args:
        steps: Per step, ``{"comm": [...], "compute": [...]}`` as the harness records them.
        step_times_s: The measured time of the same steps (for ``other_s``: what a step spends outside the schedule).
        link_gbps: The link's rate when known (an emulated link); without it the bandwidth is fitted to the
            all-to-alls' durations with no latency.
        num_layers: Layers of the model (dense ones have no all-to-all; their compute lies in the neighbouring
            segments, as the plain path records it).
        segments: Full recompute's segments (``segment_of``), as the steps ran them: the replay's forward is priced
            as the forward's; what the plain path recorded of it is taken off the backward (a dense layer's replay,
            which has no all-to-all to mark it, stays in its neighbours' backward).
    """
    compute, comm, other = _samples(steps, step_times_s)
    # The plain path records one segment per (node, layer) and microbatch: medians are per-microbatch costs.
    med = {key: statistics.median(values) for key, values in compute.items()}
    meta = [t for (op, _), values in comm.items() if op == "split_exchange" for _, t in values]
    comm = {key: values for key, values in comm.items() if not key[0].endswith("split_exchange")}
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
                b_pre=_down_to(seg, below[-1]) if below else seg("plain backward_end", -1),
                dispatch_bytes=nbytes("dispatch", j),
                combine_bytes=nbytes("combine", j),
            )
            if j in moe
            else LayerCosts(0.0, 0.0, 0.0, 0.0)
        )
    costs = StepCosts(
        layers=tuple(layers),
        f_tail=seg("plain forward_end", -1),
        b_head=_down_to(seg, moe[-1]) if moe else 0.0,
        other_s=statistics.median(other),
        segments=tuple(segments),
    )
    return costs, _link_of([sample for values in comm.values() for sample in values], link_gbps, meta)


def _samples(steps: list[dict], step_times_s: list[float]) -> tuple[dict, dict, list[float]]:
    """Per (node, layer) the compute segments' seconds, per (op, layer) the all-to-alls' (bytes, seconds), and per
    step the time spent after the last record (outside the schedule)."""
    compute: dict[tuple[str, int], list[float]] = defaultdict(list)
    comm: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    other = []
    for step, total in zip(steps, step_times_s):
        for r in step["compute"]:
            compute[(r["node"], r["layer"])].append(r["end_s"] - r["start_s"])
        for r in step["comm"]:
            comm[(r["op"], r["layer"])].append((max(r["bytes_sent"], r["bytes_received"]), r["end_s"] - r["start_s"]))
        ends = [r["end_s"] for r in step["compute"]] + [r["end_s"] for r in step["comm"]]
        other.append(max(0.0, total - max(ends)))
    return compute, comm, other


def _down_to(seg, layer: int) -> float:
    """Backward from the all-to-all above down to ``layer``'s combine backward (``seg``: a plain segment's median).
    With full recompute the plain path replays ``layer``'s forward on the way (``replay_*`` records): its
    pre-dispatch part, as long as the forward's, is taken off."""
    replay = seg("plain replay_split_exchange", layer) + seg("plain replay_dispatch", layer)
    f_pre = seg("plain split_exchange", layer) + seg("plain dispatch", layer)
    return seg("plain combine_bwd", layer) + (max(0.0, replay - f_pre) if replay else 0.0)


def _link_of(samples: list[tuple[float, float]], link_gbps: float | None, meta: list[float]) -> Link:
    """The link from the all-to-alls' (bytes, seconds): at ``link_gbps`` with the median excess as latency, or, rate
    unknown, the bandwidth that fits them with no latency; a split-size round trip is the median of ``meta``."""
    if link_gbps:
        bandwidth = link_gbps * 1e9 / 8
        latency = max(0.0, statistics.median(t - b / bandwidth for b, t in samples)) if samples else 0.0
    else:
        bandwidth = sum(b for b, _ in samples) / max(sum(t for _, t in samples), 1e-12) if samples else 1e12
        latency = 0.0
    return Link(bandwidth_Bps=bandwidth, latency_s=latency, meta_s=statistics.median(meta) if meta else 0.0)


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
