"""How much communication ran beside compute, from a profile: interval unions, never summed kernel time.

Reads a torch-profiler Chrome trace (``.json``, ``.json.gz``) or an Nsight Systems SQLite export
(``nsys export --type sqlite``), of any run: this project's schedule, Megatron-Core's own overlap, or plain
Megatron-LM. No torch is needed.

Contract:
    * An activity is an interval (start, end) with a name. On a GPU trace the activities are the device's kernels
      (every stream); on a trace with no kernel (a CPU run) they are the host's operators and the process group's
      own work spans (``gloo:all_to_all`` on gloo's worker thread, which is the transfer; the host's ``c10d::``
      call is then only its launch and is left out). Each is communication
      when its name matches a row of :data:`COMM_PATTERNS` (a table a user extends with ``--comm PATTERN``), else
      compute.
    * A step is the window of a range whose name matches ``step_pattern`` (torch's ``ProfilerStep#N``, or an NVTX
      ``step N``); with none, the whole trace is one step. Activities are clipped to the window.
    * Memory copies and sets (a Chrome trace's ``gpu_memcpy``/``gpu_memset``, an nsys export's
      ``CUPTI_ACTIVITY_KIND_MEMCPY``/``MEMSET``) are neither: they get a figure of their own, in both formats alike.
    * Per step: the union of communication intervals, the union of compute intervals, their intersection (time
      communication ran with compute beside it), the exposed communication (union minus intersection) and the
      concurrent fraction (intersection / communication union, as Megatron-Bridge #5094 reports it). Overlapping,
      nested and touching intervals count once, whichever stream they ran on.
    * Per range name (NVTX, or the host's annotations) where ranges exist: the same figures inside that name's
      ranges (communication and compute both clipped to them), the numbers in a name (``L3``, ``mb2``) folded so one
      row stands for every layer and microbatch.
    * The work is linear in the activities (plus a logarithm per step): the unions are built once and each step
      takes its slice of them.
    * A file that is missing, malformed (a truncated ``.gz`` too), empty, holds an event whose time is not a finite
      number or whose duration is negative, or has no communication raises :class:`TraceError`, whose text is the
      one line to print.
"""

import bisect
import gzip
import json
import math
import re
import sqlite3
import zlib
from dataclasses import dataclass, field
from pathlib import Path

# (what, pattern): communication kernels and operators by name. Searched case-insensitively; extend with --comm.
COMM_PATTERNS = [
    ("NCCL", r"nccl"),
    ("DeepEP / HybridEP", r"deep_?ep|hybrid_?ep"),
    ("NCCL EP", r"nccl_?ep"),
    ("gloo (CPU)", r"gloo|c10d::|all_to_all|alltoall|allreduce|all_reduce|allgather|all_gather"),
    ("ep_overlap stand-ins", r"^fake_deepep"),
]
STEP_PATTERN = r"^ProfilerStep#\d+$|^step[ _#]?\d+$"


class TraceError(ValueError):
    """A trace this tool cannot read; ``str()`` is the one line to print."""


@dataclass
class Activity:
    name: str
    start: float  # seconds
    end: float


@dataclass
class Trace:
    """What a file holds: the activities, the ranges (NVTX or host annotations), and which the steps are."""

    path: str
    activities: list[Activity]
    ranges: list[Activity] = field(default_factory=list)
    device: bool = True  # the activities are device kernels (else host operators)
    copies: list[Activity] = field(default_factory=list)  # memory copies and sets: neither comm nor compute


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint, sorted intervals covering exactly the given ones (touching ones merged)."""
    merged: list[list[float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intersection of two disjoint sorted interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def clip(intervals: list[tuple[float, float]], window: tuple[float, float]) -> list[tuple[float, float]]:
    return [(max(a, window[0]), min(b, window[1])) for a, b in intervals if min(b, window[1]) > max(a, window[0])]


class Timeline:
    """A union of intervals (disjoint, sorted) that hands out its part inside a window by bisection."""

    def __init__(self, intervals: list[tuple[float, float]]):
        self.spans = union(intervals)
        self._starts = [a for a, _ in self.spans]

    def within(self, window: tuple[float, float]) -> list[tuple[float, float]]:
        first = max(bisect.bisect_right(self._starts, window[0]) - 1, 0)
        return clip(self.spans[first : bisect.bisect_left(self._starts, window[1])], window)


@dataclass
class Figures:
    """Seconds of one window: communication union, compute union, both at once, and what they give."""

    comm_s: float
    compute_s: float
    concurrent_s: float
    copy_s: float = 0.0  # memory copies and sets

    @property
    def exposed_s(self) -> float:
        return self.comm_s - self.concurrent_s

    @property
    def concurrent_fraction(self) -> float:
        return self.concurrent_s / self.comm_s if self.comm_s > 0 else 0.0


def figures(comm: list[tuple[float, float]], compute: list[tuple[float, float]], copies=()) -> Figures:
    comm_u, compute_u = union(comm), union(compute)
    return Figures(length(comm_u), length(compute_u), length(intersect(comm_u, compute_u)), length(union(copies)))


def classifier(extra: list[str] = ()):
    patterns = [re.compile(p, re.IGNORECASE) for _, p in COMM_PATTERNS] + [re.compile(p, re.I) for p in extra]
    return lambda name: any(p.search(name) for p in patterns)


@dataclass
class StepFigures:
    name: str
    window: tuple[float, float]
    total: Figures
    by_range: dict[str, Figures]


def analyze(trace: Trace, extra_comm: list[str] = (), step_pattern: str = STEP_PATTERN) -> list[StepFigures]:
    """The figures of every step of ``trace`` (see the module docstring).

    Raises:
        TraceError: When the trace holds no communication at all.
    """
    is_comm = classifier(extra_comm)
    comm = [(a.start, a.end) for a in trace.activities if is_comm(a.name)]
    compute = [(a.start, a.end) for a in trace.activities if not is_comm(a.name)]
    if not comm:
        kinds = ", ".join(what for what, _ in COMM_PATTERNS)
        raise TraceError(
            f"{trace.path}: no communication in {len(trace.activities)} activities (looked for {kinds}); add a "
            "pattern with --comm, or profile a run that communicates"
        )
    step_re = re.compile(step_pattern)
    steps = sorted((r for r in trace.ranges if step_re.search(r.name)), key=lambda r: r.start)
    if not steps:
        everything = [(a.start, a.end) for a in trace.activities]
        steps = [Activity("whole trace", min(a for a, _ in everything), max(b for _, b in everything))]
    comm_t, compute_t = Timeline(comm), Timeline(compute)
    copies_t = Timeline([(a.start, a.end) for a in trace.copies])
    named = _Ranges([r for r in trace.ranges if not step_re.search(r.name)])
    out = []
    for step in steps:
        window = (step.start, step.end)
        step_comm, step_compute = comm_t.within(window), compute_t.within(window)
        by_range: dict[str, list] = {}
        for r in named.overlapping(window):
            by_range.setdefault(_fold(r.name), []).extend(clip([(r.start, r.end)], window))
        rows = {}
        for name, spans in sorted(by_range.items()):
            inside = union(spans)
            rows[name] = figures(intersect(step_comm, inside), intersect(step_compute, inside))
        out.append(StepFigures(step.name, window, figures(step_comm, step_compute, copies_t.within(window)), rows))
    return out


class _Ranges:
    """Named ranges sorted by start, for the ones that overlap a window without scanning them all."""

    def __init__(self, ranges: list[Activity]):
        self.ranges = sorted(ranges, key=lambda r: r.start)
        self._starts = [r.start for r in self.ranges]
        self._longest = max((r.end - r.start for r in self.ranges), default=0.0)

    def overlapping(self, window: tuple[float, float]) -> list[Activity]:
        first = bisect.bisect_left(self._starts, window[0] - self._longest)
        last = bisect.bisect_left(self._starts, window[1])
        return [r for r in self.ranges[first:last] if r.end > window[0]]


def _fold(name: str) -> str:
    """One row per kind of range: layer and microbatch numbers folded (``L3`` -> ``L*``, ``mb2`` -> ``mb*``)."""
    return re.sub(r"\d+", "*", name)


# ---- reading the two formats -----------------------------------------------------------------------------------


def read_trace(path: str) -> Trace:
    """A Chrome trace (torch profiler) or an Nsight Systems SQLite export, by content.

    Raises:
        TraceError: The file is missing, unreadable, malformed, or has no activity.
    """
    file = Path(path)
    try:
        head = file.open("rb").read(16)
    except OSError as exc:
        raise TraceError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if head.startswith(b"SQLite format 3"):
        trace = _read_sqlite(path)
    else:
        trace = _read_chrome(path, head)
    if not trace.activities:
        raise TraceError(f"{path}: no kernel or operator in the trace; profile at least one step")
    return trace


def _read_chrome(path: str, head: bytes) -> Trace:
    try:
        raw = gzip.open(path).read() if head.startswith(b"\x1f\x8b") else Path(path).read_bytes()
        data = json.loads(raw) if raw.strip() else None
    except (OSError, EOFError, zlib.error, ValueError) as exc:  # a truncated .gz ends in EOFError
        what = "JSON" if isinstance(exc, ValueError) else "gzip"
        raise TraceError(f"{path}: not a Chrome trace ({what}: {exc}); give a torch-profiler trace or an nsys "
                         "SQLite export") from None  # fmt: skip
    if data is None:
        raise TraceError(f"{path}: empty; give a torch-profiler trace or an nsys SQLite export")
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise TraceError(f"{path}: no traceEvents list; give a torch-profiler Chrome trace")
    complete = [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e and "dur" in e]
    try:
        spans = [(str(e.get("name", "")), str(e.get("cat", "")), float(e["ts"]) * 1e-6, float(e["dur"]) * 1e-6)
                 for e in complete]  # fmt: skip
    except (TypeError, ValueError) as exc:
        raise TraceError(f"{path}: an event's ts or dur is not a number ({exc})") from None
    _check_times(path, ((n, t, t + d) for n, _, t, d in spans))
    kernels = [Activity(n, t, t + d) for n, c, t, d in spans if c.lower() == "kernel"]
    copies = [Activity(n, t, t + d) for n, c, t, d in spans if c.lower() in ("gpu_memcpy", "gpu_memset")]
    annotations = [(n, t, d) for n, c, t, d in spans if c.lower() in ("user_annotation", "gpu_user_annotation")]
    # A process group's own work spans (gloo:all_to_all on gloo's worker thread): the transfer itself, not a range.
    work = [Activity(n, t, t + d) for n, t, d in annotations if _WORK.match(n)]
    ranges = [Activity(n, t, t + d) for n, t, d in annotations if not _WORK.match(n)]
    if kernels:
        return Trace(path, kernels, ranges, device=True, copies=copies)
    operators = [Activity(n, t, t + d) for n, c, t, d in spans if c.lower() == "cpu_op"]
    if work:  # then the host's c10d:: calls are only the launches of that work
        operators = [a for a in operators if not a.name.startswith("c10d::")] + work
    return Trace(path, operators, ranges, device=False, copies=copies)


def _check_times(path: str, events) -> None:
    """Refuses the first event whose start or end is not a finite number, or that ends before it starts."""
    for name, start, end in events:
        if not (math.isfinite(start) and math.isfinite(end)) or end < start:
            raise TraceError(
                f"{path}: the event {name!r} has start {start!r} s and end {end!r} s (a time that is not a finite "
                "number, or a negative duration); fix: profile again, or drop the broken event"
            )


_WORK = re.compile(r"^(gloo|nccl):")


def _read_sqlite(path: str) -> Trace:
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "CUPTI_ACTIVITY_KIND_KERNEL" not in tables:
            raise TraceError(f"{path}: an SQLite file without CUPTI_ACTIVITY_KIND_KERNEL; give `nsys export "
                             "--type sqlite` of a GPU profile")  # fmt: skip
        strings = dict(db.execute("SELECT id, value FROM StringIds")) if "StringIds" in tables else {}
        kernels = [
            Activity(strings.get(name, str(name)), start * 1e-9, end * 1e-9)
            for start, end, name in db.execute("SELECT start, end, shortName FROM CUPTI_ACTIVITY_KIND_KERNEL")
        ]
        copies = [
            Activity(table, start * 1e-9, end * 1e-9)
            for table in ("CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET")
            if table in tables
            for start, end in db.execute(f"SELECT start, end FROM {table}")
        ]
        _check_times(path, ((a.name, a.start, a.end) for a in kernels + copies))
        ranges = []
        if "NVTX_EVENTS" in tables:
            columns = {row[1] for row in db.execute("PRAGMA table_info(NVTX_EVENTS)")}
            text_id = "textId" if "textId" in columns else "NULL"
            for start, end, text, tid in db.execute(f"SELECT start, end, text, {text_id} FROM NVTX_EVENTS"):
                if end is not None and end > start:
                    ranges.append(
                        Activity(text if text is not None else strings.get(tid, ""), start * 1e-9, end * 1e-9)
                    )
        return Trace(path, kernels, ranges, device=True, copies=copies)
    except sqlite3.Error as exc:
        raise TraceError(f"{path}: a malformed SQLite export ({exc})") from None


# ---- the report -------------------------------------------------------------------------------------------------


def _row(label: str, f: Figures, copies: bool = False) -> str:
    return (
        f"{label}: comm {f.comm_s * 1e3:.3f} ms, compute {f.compute_s * 1e3:.3f} ms, concurrent "
        f"{f.concurrent_s * 1e3:.3f} ms, exposed comm {f.exposed_s * 1e3:.3f} ms, concurrent fraction "
        f"{100 * f.concurrent_fraction:.2f}%" + (f", copies {f.copy_s * 1e3:.3f} ms" if copies else "")
    )


def report(trace: Trace, steps: list[StepFigures]) -> list[str]:
    kind = "device kernels" if trace.device else "host operators (a CPU trace: see perf-harness.md)"
    lines = [f"{trace.path}: {len(trace.activities)} {kind}, {len(steps)} step(s)"]
    for step in steps:
        lines.append("  " + _row(step.name, step.total, copies=bool(trace.copies)))
        lines += ["    " + _row(f"in {name}", f) for name, f in step.by_range.items() if f.comm_s > 0]
    return lines


def compare(a: list[StepFigures], b: list[StepFigures]) -> list[str]:
    """Two runs side by side: per step index present in both, each figure and B - A."""
    lines = ["step  figure               A            B            B - A"]
    for i, (sa, sb) in enumerate(zip(a, b)):
        for label, get in (
            ("comm ms", lambda f: f.comm_s * 1e3),
            ("compute ms", lambda f: f.compute_s * 1e3),
            ("concurrent ms", lambda f: f.concurrent_s * 1e3),
            ("exposed comm ms", lambda f: f.exposed_s * 1e3),
            ("concurrent %", lambda f: 100 * f.concurrent_fraction),
        ):
            va, vb = get(sa.total), get(sb.total)
            lines.append(f"{i:<5} {label:<18} {va:>12.3f} {vb:>12.3f} {vb - va:>+12.3f}")
    if len(a) != len(b):
        lines.append(f"(A has {len(a)} step(s), B {len(b)}: the first {min(len(a), len(b))} compared)")
    return lines
