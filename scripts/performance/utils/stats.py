"""Matched A/B statistics: per-step paired values, medians and 95% bootstrap confidence intervals.

Both arms run the same step index back to back (ABBA order), so each step gives one matched pair. Every figure
is the median over steady steps with a percentile bootstrap interval (resampling steps, fixed seed, so a report
is reproducible from its data).
"""

from typing import Any

import numpy as np

RESAMPLES = 4000


MIN_STEPS_FOR_INTERVAL = 3  # a bootstrap of fewer values says nothing about the spread
TOO_FEW = "too few steps for an interval"


def format_ci(figure: dict[str, Any], fmt: str, label: str = "") -> str:
    """``median [label lo, hi]`` of a :func:`median_ci` figure, or the median and why there is no interval."""
    if figure["ci95"] is None:
        return f"{fmt.format(figure['median'])} ({TOO_FEW})"
    lo, hi = figure["ci95"]
    return f"{fmt.format(figure['median'])} [{label}{fmt.format(lo)}, {fmt.format(hi)}]"


def median_ci(values: list[float], seed: int = 0) -> dict[str, Any]:
    """``{"median": m, "ci95": [lo, hi]}`` of ``values`` (a 95% percentile bootstrap of the median); ``ci95`` is
    None with fewer than :data:`MIN_STEPS_FOR_INTERVAL` values."""
    data = np.asarray(values, dtype=float)
    if len(data) < MIN_STEPS_FOR_INTERVAL:
        return {"median": float(np.median(data)), "ci95": None}
    picks = np.random.default_rng(seed).integers(0, len(data), size=(RESAMPLES, len(data)))
    lo, hi = np.percentile(np.median(data[picks], axis=1), [2.5, 97.5])
    return {"median": float(np.median(data)), "ci95": [float(lo), float(hi)]}


def step_series(per_rank: list[dict], key: str, combine=max) -> list[float]:
    """One value per step across ranks: a step lasts as long as its slowest rank (``max``), comm is averaged."""
    return [combine(r[key][s] for r in per_rank) for s in range(len(per_rank[0][key]))]


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def matched_ab(baseline: list[dict], overlap: list[dict], warmup: int) -> dict[str, Any]:
    """Speedup, hidden fraction and exposed comm of a matched A/B, per steady step, with their intervals.

    Per step s: speedup = T_baseline / T_overlap; with T_comm the baseline's comm time (all of it exposed there)
    and T_compute = T_baseline - T_comm, the hidden fraction is h = (T_baseline - T_overlap) / min(T_compute,
    T_comm): the share of the time that overlap could hide at best that it did hide.
    """
    base, over = step_series(baseline, "step_times_s")[warmup:], step_series(overlap, "step_times_s")[warmup:]
    ratios = [b / o for b, o in zip(base, over)]
    speedup = median_ci(ratios)
    if speedup["ci95"] is None:
        speedup["verdict"] = TOO_FEW
    else:
        lo, hi = speedup["ci95"]
        speedup["verdict"] = (
            "no measurable difference" if lo <= 1.0 <= hi else ("overlap faster" if lo > 1.0 else "overlap slower")
        )
    if any(r["comm_s"][0] is None for r in baseline):  # a Megatron-Core pipeline arm keeps no comm figures
        return {"steady_steps": len(ratios), "speedup": speedup, "h": None, "exposed_comm_s": None, "h_lost": None}
    comm = step_series(baseline, "comm_s", _mean)[warmup:]
    exposed = step_series(overlap, "exposed_comm_s", _mean)[warmup:]
    extra_wait = None
    if all(r.get("host_waited_for_core_s") for r in baseline + overlap):
        waited = [step_series(arm, "host_waited_for_core_s", _mean)[warmup:] for arm in (baseline, overlap)]
        extra_wait = [o - b for b, o in zip(*waited)]
    hidden = [(b - o) / min(b - c, c) for b, o, c in zip(base, over, comm)]
    return {
        "steady_steps": len(ratios),
        "speedup": speedup,
        "h": median_ci(hidden),
        "exposed_comm_s": {
            "baseline": median_ci(step_series(baseline, "exposed_comm_s", _mean)[warmup:]),
            "overlap": median_ci(exposed),
        },
        "h_lost": h_lost(base, over, comm, exposed, extra_wait),
    }


def h_lost(
    base: list[float], over: list[float], comm: list[float], exposed: list[float], extra_wait: list[float] | None
) -> dict[str, Any] | None:
    """Where the hideable time that overlap did not hide went, as shares of T_comm, per compute-bound step.

    A compute-bound step (T_comm <= T_compute) would ideally take T_compute, so 1 - h = (T_overlap - T_compute) /
    T_comm, which splits into: the overlap arm's exposed comm; how much longer its host waited for a core than the
    baseline's (where both arms measured it: communication taking CPU from compute, which the baseline's idle waits
    absorb); and the rest (compute that ran slower or faster than the baseline's beyond that, skew between ranks).
    The parts add up to 1 - h step by step, not their medians. Arguments are per steady step: the arms' step times,
    the baseline's comm, the overlap arm's exposed comm, and its extra wait (``None`` where the OS does not report
    the wait). Returns ``None`` when no step is compute-bound.
    """
    parts: dict[str, list[float]] = {"exposed_comm": [], "waited_for_core": [], "rest": []}
    for b, o, c, e, w in zip(base, over, comm, exposed, extra_wait or [0.0] * len(comm)):
        if not 0 < c <= b - c:
            continue
        parts["exposed_comm"].append(e / c)
        parts["waited_for_core"].append(w / c)
        parts["rest"].append((o - (b - c) - e - w) / c)
    if not parts["rest"]:
        return None
    lost = {name: median_ci(values) for name, values in parts.items()}
    if extra_wait is None:
        lost["waited_for_core"] = None
    lost["steps"] = len(parts["rest"])
    return lost


def describe_matched(matched: dict[str, Any], bound: float) -> list[str]:
    """The report lines of :func:`matched_ab`."""

    def ci(figure: dict[str, Any], fmt: str) -> str:
        return format_ci(figure, fmt, label="95% CI ")

    speedup = matched["speedup"]
    if speedup["verdict"] == "no measurable difference":
        first = f"speedup: no measurable difference (matched per-step ratio {ci(speedup, '{:.3f}x')})"
    else:
        first = (
            f"speedup (matched per-step ratio, median of {matched['steady_steps']} steps): {ci(speedup, '{:.3f}x')}"
        )
    if matched["h"] is None:  # no comm figures (a Megatron-Core pipeline arm)
        return [first]
    exposed = matched["exposed_comm_s"]
    lines = [
        first,
        f"hidden fraction h of the hideable time: {ci(matched['h'], '{:.2f}')} "
        f"(pairing bound {bound:.3f}: the share of forwards that run beside another microbatch)",
        f"exposed comm / step (s): baseline {ci(exposed['baseline'], '{:.3f}')}, "
        f"overlap {ci(exposed['overlap'], '{:.3f}')}",
    ]
    lost = matched.get("h_lost")
    if lost:
        wait = lost["waited_for_core"]
        lines.append(
            f"1 - h, split into shares of T_comm (median of {lost['steps']} compute-bound steps): exposed comm "
            f"{ci(lost['exposed_comm'], '{:.2f}')}"
            + (f", the host's extra wait for a core {ci(wait, '{:.2f}')}" if wait else "")
            + f", the rest {ci(lost['rest'], '{:.2f}')}"
        )
    return lines
