"""Aggregating per-rank arm results into the A/B summary, its table, JSON and timeline figure."""

import json
import statistics
from typing import Any

import torch

from ep_overlap_lab.planner import exposed_by_phase_and_kind
from utils.stats import describe_matched


def _steady(values: list[float], warmup: int) -> list[float]:
    return values[warmup:] if len(values) > warmup else values


PHASE_ORDER = ("warmup", "paired", "steady", "cooldown", "plain")


def _exposed_breakdown(per_rank: list[dict], warmup: int) -> dict[str, dict[str, float]]:
    """Median over steady steps of the rank-mean exposed time, per phase and kind."""
    steps = len(per_rank[0]["records"])
    per_step = [[exposed_by_phase_and_kind(r["records"][s]) for r in per_rank] for s in range(steps)]
    keys = sorted(
        {(phase, kind) for step in per_step for rank in step for phase in rank for kind in rank[phase]},
        key=lambda key: (PHASE_ORDER.index(key[0]) if key[0] in PHASE_ORDER else len(PHASE_ORDER), key),
    )
    steady = _steady(list(range(steps)), warmup)
    out: dict[str, dict[str, float]] = {}
    for phase, kind in keys:
        values = [statistics.fmean(rank.get(phase, {}).get(kind, 0.0) for rank in per_step[s]) for s in steady]
        out.setdefault(phase, {})[kind] = statistics.median(values)
    return out


def summarize_arm(per_rank: list[dict], warmup: int, tokens_per_step: int) -> dict[str, Any]:
    """One arm across ranks: a step lasts as long as its slowest rank; comm figures are averaged over ranks."""
    steps = len(per_rank[0]["step_times_s"])
    step_times = [max(r["step_times_s"][s] for r in per_rank) for s in range(steps)]
    steady = _steady(step_times, warmup)
    median = statistics.median(steady)
    comm_median = exposed_median = None  # a Megatron-Core pipeline arm keeps no comm figures
    if per_rank[0]["comm_s"][0] is not None:
        comm = [statistics.fmean(r["comm_s"][s] for r in per_rank) for s in range(steps)]
        exposed = [statistics.fmean(r["exposed_comm_s"][s] for r in per_rank) for s in range(steps)]
        comm_median = statistics.median(_steady(comm, warmup))
        exposed_median = statistics.median(_steady(exposed, warmup))
    waited = None
    if all(r.get("host_waited_for_core_s") for r in per_rank):
        per_step = [statistics.fmean(r["host_waited_for_core_s"][s] for r in per_rank) for s in range(steps)]
        waited = statistics.median(_steady(per_step, warmup))
    return {
        "step_times_s": step_times,
        "median_step_time_s": median,
        "min_step_time_s": min(steady),
        "tokens_per_s": tokens_per_step / median,
        "losses": per_rank[0]["losses"],
        "comm_s": comm_median,
        "exposed_comm_s": exposed_median,
        "overlap_fraction": (
            None if comm_median is None else 0.0 if comm_median <= 0 else 1.0 - exposed_median / comm_median
        ),
        "peak_memory_mb": max(r["peak_memory_mb"] for r in per_rank),
        # The most any rank held for backward at once, over the steady steps (exact: engine/saved.py).
        "activation_peak_bytes": max(max(_steady(r["activation_peak_bytes"], warmup)) for r in per_rank),
        "host_waited_for_core_s": waited,  # None where the OS does not report it
        "attention_wgrad_window": per_rank[0].get("attention_wgrad_window"),  # as run (auto: as chosen)
        "launch_off_host": per_rank[0].get("launch_off_host"),  # as run (auto: whether it applied)
        "profile_trace": per_rank[0].get("profile_trace"),  # --profile: rank 0's trace of its extra step
        "exposed_comm_s_by_phase": _exposed_breakdown(per_rank, warmup),
        "timeline": {r["rank"]: r["timeline"] for r in per_rank},
        "records": {r["rank"]: r["records"] for r in per_rank},
    }


def bitwise_equal(a: list[dict], b: list[dict]) -> dict[str, bool]:
    """Losses (bit patterns, every rank and step) and final parameters (digest per rank) of two arms."""
    losses = all(
        torch.equal(x.view(torch.int32), y.view(torch.int32))  # losses are fp32 (cross-entropy in fp32)
        for ra, rb in zip(a, b)
        for x, y in zip(ra["loss_bits"], rb["loss_bits"])
    )
    params = all(ra["param_digest"] == rb["param_digest"] for ra, rb in zip(a, b))
    relative = max(
        ((x.double() - y.double()).abs() / y.double().abs().clamp_min(1e-30)).max().item()
        for ra, rb in zip(a, b)
        for x, y in zip(ra["loss_bits"], rb["loss_bits"])
    )
    return {
        "bitwise_equal": losses and params,
        "losses_equal": losses,
        "params_equal": params,
        "max_loss_rel_diff": relative,
    }


ROWS = (
    ("median step time (s)", "median_step_time_s", "{:.3f}"),
    ("min step time (s)", "min_step_time_s", "{:.3f}"),
    ("tokens/s", "tokens_per_s", "{:,.0f}"),
    ("comm time / step (s)", "comm_s", "{:.3f}"),
    ("exposed comm / step (s)", "exposed_comm_s", "{:.3f}"),
    ("overlap fraction", "overlap_fraction", "{:.2f}"),
    ("peak memory (MB)", "peak_memory_mb", "{:,.0f}"),
    ("activations held, peak (MB)", "activation_peak_bytes", lambda v: f"{v / 2**20:,.3f}"),
    ("host waited for a core (s)", "host_waited_for_core_s", "{:.3f}"),
)


def _cell(value, fmt) -> str:
    if value is None:
        return "n/a"
    return fmt(value) if callable(fmt) else fmt.format(value)


def format_table(summary: dict[str, Any]) -> str:
    arms = summary["arms"]
    names = list(arms)
    lines = [summary["title"], f"{'':28}" + "".join(f"{name:>14}" for name in names)]
    for label, key, fmt in ROWS:
        lines.append(f"{label:28}" + "".join(f"{_cell(arms[n].get(key), fmt):>14}" for n in names))
    if "numerics" in summary:
        numerics = summary["numerics"]
        expected = numerics.get("expected_bitwise", True)
        verdict = "yes" if numerics["bitwise_equal"] else ("NO" if expected else "no (expected: chunking)")
        lines.append(
            f"losses and final parameters bitwise equal: {verdict} "
            f"(losses {numerics['losses_equal']}, parameters {numerics['params_equal']}"
            + (f"; largest relative loss difference {numerics['max_loss_rel_diff']:.1e})" if not expected else ")")
        )
    if "placement" in summary:
        lines.append(f"placement: {summary['placement']}")
    lines += describe_exposed_by_phase(arms)
    if "activation_peak_bytes" in summary:
        held = summary["activation_peak_bytes"]
        planned = held.get("planned_balanced_routing")
        lines.append(
            f"activations held for backward, peak per rank: overlap {held['ratio']:.2f}x the baseline's "
            f"({held['overlap'] / 2**20:,.3f} MB vs {held['baseline'] / 2**20:,.3f} MB)"
            + (
                f"; the planner's count with balanced routing: {planned['overlap'] / 2**20:,.3f} MB vs "
                f"{planned['baseline'] / 2**20:,.3f} MB"
                + (" (with recompute: at most this)" if summary.get("recompute_modules") else "")
                if planned
                else ""
            )
        )
    if "speedup" in summary:
        lines += describe_matched(summary, summary.get("bound"))
    if "prediction" in summary:
        lines += describe_prediction(summary)
    return "\n".join(lines)


def describe_exposed_by_phase(arms: dict[str, Any]) -> list[str]:
    """Exposed comm per phase of the step and kind of transfer (all-to-all, pipeline P2P), per arm."""
    lines = ["exposed comm / step by phase (s):"]
    if not any(arm["exposed_comm_s_by_phase"] for arm in arms.values()):
        return []  # no arm recorded its comm (a Megatron-Core pipeline)
    for name, arm in arms.items():
        parts = [
            f"{phase} {kind} {seconds:.3f}"
            for phase, kinds in arm["exposed_comm_s_by_phase"].items()
            for kind, seconds in sorted(kinds.items())
        ]
        lines.append(f"  {name:12} " + ", ".join(parts))
    return lines


def describe_prediction(summary: dict[str, Any]) -> list[str]:
    """The planner's prediction beside the measurement."""
    p, arms = summary["prediction"], summary["arms"]
    measured = arms["overlap"]["median_step_time_s"]
    error = 100 * (p["overlap_step_s"] / measured - 1)
    lines = [
        f"planner (fed the baseline's records): baseline {p['baseline_step_s']:.3f} s, overlap "
        f"{p['overlap_step_s']:.3f} s (measured {measured:.3f} s, {error:+.1f}%), "
        f"h {p['h']:.2f} (measured {summary['h']['median']:.2f})"
    ]
    for phase, values in p["exposed_comm_s_by_phase"].items():
        lines.append(
            f"  exposed comm in {phase}: predicted {values['predicted']:.3f} s, measured {values['measured']:.3f} s"
        )
    return lines


def partial_summary(status: str, finished: dict[str, list[dict]], config: dict[str, Any]) -> dict[str, Any]:
    """What a run that did not finish still has: its status and, per arm, every step some rank finished.

    Args:
        status: Why the run ended, in one line.
        finished: Per arm, the step reports (one per rank and step) received before the end.
        config: The run's configuration, as in a complete summary.
    """
    steps: dict[str, dict[int, dict[str, Any]]] = {}
    for arm, reports in finished.items():
        for report in reports:
            step = steps.setdefault(arm, {}).setdefault(report["step"], {"step": report["step"], "ranks": 0})
            step["ranks"] += 1
            step["step_time_s"] = max(step.get("step_time_s", 0.0), report["step_time_s"])
            for key in ("loss", "comm_s", "exposed_comm_s"):
                step.setdefault(key, report[key])
    return {
        "status": status,
        "config": config,
        "completed_steps": {arm: [by_step[k] for k in sorted(by_step)] for arm, by_step in steps.items()},
    }


def write_json(summary: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(summary, f, indent=2, default=str)


def save_json(summary: dict[str, Any], path: str) -> tuple[str, str | None]:
    """Writes ``summary`` to ``path``; when that fails (the folder became read-only, the disk filled), to a file
    beside the run instead (the working folder, else the temporary folder), so no result is lost to an I/O error.

    Returns:
        Where it went, and the one line saying why not at ``path`` (None when it went there).
    """
    import os
    import tempfile

    try:
        write_json(summary, path)
        return path, None
    except OSError as exc:
        problem = f"--json={path!r}: cannot be written now ({exc.strerror or exc})"
    name = f"ep_overlap_ab-{os.getpid()}.json"
    for folder in (os.getcwd(), tempfile.gettempdir()):
        fallback = os.path.join(folder, name)
        try:
            write_json(summary, fallback)
            return fallback, problem
        except OSError:
            continue
    raise OSError(f"{problem}; nor in {os.getcwd()} or {tempfile.gettempdir()}")


def draw_timeline(summary: dict[str, Any], path: str) -> None:
    """One steady step per arm: a compute lane and a comm lane per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = summary["arms"]
    fig, axes = plt.subplots(len(arms), 1, figsize=(12, 1.6 + 1.1 * len(arms) * 2), squeeze=False)
    for ax, (name, arm) in zip(axes[:, 0], arms.items()):
        labels = []
        for row, (rank, lanes) in enumerate(sorted(arm["timeline"].items())):
            y = 2 * row
            ax.broken_barh([(s, e - s) for s, e in lanes["compute"]], (y + 1, 0.8), color="tab:blue")
            ax.broken_barh([(s, e - s) for s, e in lanes["comm"]], (y, 0.8), color="tab:orange")
            labels += [f"rank {rank} comm", f"rank {rank} compute"]
        ax.set_yticks([i + 0.4 for i in range(len(labels))], labels)
        ax.set_title(
            f"{name}: step {arm['step_times_s'][-1]:.3f} s, comm {arm['comm_s']:.3f} s, "
            f"exposed {arm['exposed_comm_s']:.3f} s, activations held (peak) "
            f"{arm['activation_peak_bytes'] / 2**20:,.3f} MB"
        )
        ax.set_xlabel("seconds from step start")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
