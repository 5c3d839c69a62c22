"""Matched A/B statistics: per-step paired values, medians and 95% bootstrap confidence intervals.

Both arms run the same step index back to back (ABBA order), so each step gives one matched pair. Every figure
is the median over steady steps with a percentile bootstrap interval (resampling steps, fixed seed, so a report
is reproducible from its data).
"""

from typing import Any

import numpy as np

RESAMPLES = 4000


def median_ci(values: list[float], seed: int = 0) -> dict[str, Any]:
    """``{"median": m, "ci95": [lo, hi]}`` of ``values`` (a 95% percentile bootstrap of the median)."""
    data = np.asarray(values, dtype=float)
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
    comm = step_series(baseline, "comm_s", _mean)[warmup:]
    ratios = [b / o for b, o in zip(base, over)]
    hidden = [(b - o) / min(b - c, c) for b, o, c in zip(base, over, comm)]
    speedup = median_ci(ratios)
    lo, hi = speedup["ci95"]
    speedup["verdict"] = (
        "no measurable difference" if lo <= 1.0 <= hi else ("overlap faster" if lo > 1.0 else "overlap slower")
    )
    return {
        "steady_steps": len(ratios),
        "speedup": speedup,
        "h": median_ci(hidden),
        "exposed_comm_s": {
            "baseline": median_ci(step_series(baseline, "exposed_comm_s", _mean)[warmup:]),
            "overlap": median_ci(step_series(overlap, "exposed_comm_s", _mean)[warmup:]),
        },
    }


def describe_matched(matched: dict[str, Any], bound: float) -> list[str]:
    """The report lines of :func:`matched_ab`."""

    def ci(figure: dict[str, Any], fmt: str) -> str:
        lo, hi = figure["ci95"]
        return f"{fmt.format(figure['median'])} [95% CI {fmt.format(lo)}, {fmt.format(hi)}]"

    speedup = matched["speedup"]
    if speedup["verdict"] == "no measurable difference":
        first = f"speedup: no measurable difference (matched per-step ratio {ci(speedup, '{:.3f}x')})"
    else:
        first = (
            f"speedup (matched per-step ratio, median of {matched['steady_steps']} steps): {ci(speedup, '{:.3f}x')}"
        )
    exposed = matched["exposed_comm_s"]
    return [
        first,
        f"hidden fraction h of the hideable time: {ci(matched['h'], '{:.2f}')} "
        f"(pairing bound {bound:.3f}: the share of forwards that run beside another microbatch)",
        f"exposed comm / step (s): baseline {ci(exposed['baseline'], '{:.3f}')}, "
        f"overlap {ci(exposed['overlap'], '{:.3f}')}",
    ]
