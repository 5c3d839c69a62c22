"""overlap_from_trace.py on synthetic traces whose unions and intersections are known by construction."""

import gzip
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from utils.trace_overlap import analyze, intersect, read_trace, union

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "performance" / "overlap_from_trace.py"
US = 1e-6  # a Chrome trace counts microseconds


def test_unions_merge_overlapping_nested_and_touching_intervals_once():
    assert union([(0, 4), (2, 6), (3, 5), (6, 8), (10, 11)]) == [(0, 8), (10, 11)]  # overlap, nested, touching
    assert intersect([(0, 8), (10, 11)], [(7, 10.5)]) == [(7, 8), (10, 10.5)]
    assert union([(5, 5), (1, 2)]) == [(1, 2)]  # empty intervals do not count


def _kernel(name: str, start_us: float, dur_us: float, stream: int) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": start_us, "dur": dur_us, "pid": 0, "tid": stream}


def _range(name: str, start_us: float, dur_us: float, cat: str = "user_annotation") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": start_us, "dur": dur_us, "pid": 1, "tid": 1}


# Two steps. Step 1 [0, 100): compute kernels on stream 7 at [0, 40) and, nested, [10, 20), touching [40, 60);
# NCCL on stream 9 at [30, 50) and [70, 90) (disjoint): comm 40, compute 60, concurrent 20 ([30, 50)),
# exposed 20. Step 2 [100, 200): a DeepEP dispatch [100, 150) beside a GEMM [120, 200) on another stream:
# comm 50, compute 80, concurrent 30. A dispatch range covers [30, 50) and a combine range [70, 90) in step 1.
CHROME = {
    "traceEvents": [
        _range("ProfilerStep#1", 0, 100),
        _range("ProfilerStep#2", 100, 100),
        _kernel("ampere_sgemm_128x64", 0, 40, 7),
        _kernel("elementwise_kernel", 10, 10, 7),
        _kernel("vectorized_layer_norm", 40, 20, 7),
        _kernel("ncclDevKernel_AllToAll_RING", 30, 20, 9),
        _kernel("ncclDevKernel_AllToAll_RING", 70, 20, 9),
        _kernel("deep_ep::intranode::dispatch", 100, 50, 9),
        _kernel("sm90_xmma_gemm", 120, 80, 7),
        _range("ep_overlap/F.dispatch/L3/mb2", 30, 20, "gpu_user_annotation"),
        _range("ep_overlap/F.combine/L3/mb2", 70, 20, "gpu_user_annotation"),
        {"ph": "M", "name": "process_name", "pid": 0},  # metadata events are not activities
    ]
}


def _check_known_answer(steps):
    assert [s.name for s in steps] == ["ProfilerStep#1", "ProfilerStep#2"]
    first, second = steps[0].total, steps[1].total
    assert (first.comm_s, first.compute_s, first.concurrent_s) == pytest.approx((40 * US, 60 * US, 20 * US))
    assert first.exposed_s == pytest.approx(20 * US) and first.concurrent_fraction == pytest.approx(0.5)
    assert (second.comm_s, second.compute_s, second.concurrent_s) == pytest.approx((50 * US, 80 * US, 30 * US))
    ranges = steps[0].by_range
    dispatch, combine = ranges["ep_overlap/F.dispatch/L*/mb*"], ranges["ep_overlap/F.combine/L*/mb*"]
    assert (dispatch.comm_s, dispatch.concurrent_s) == pytest.approx((20 * US, 20 * US))  # hidden behind the GEMM
    assert (combine.comm_s, combine.concurrent_s) == pytest.approx((20 * US, 0.0))  # exposed


@pytest.mark.parametrize("packed", [False, True], ids=["json", "json.gz"])
def test_a_chrome_trace_gives_the_constructed_figures(tmp_path, packed):
    path = tmp_path / ("trace.json.gz" if packed else "trace.json")
    text = json.dumps(CHROME).encode()
    path.write_bytes(gzip.compress(text) if packed else text)
    trace = read_trace(str(path))
    assert trace.device and len(trace.activities) == 7
    _check_known_answer(analyze(trace))


def _nsys_export(path: Path) -> None:
    """The tables and columns of `nsys export --type sqlite` this tool reads, in nanoseconds."""
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT)")
    db.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER, end INTEGER, streamId INTEGER, shortName "
               "INTEGER)")  # fmt: skip
    db.execute("CREATE TABLE NVTX_EVENTS (start INTEGER, end INTEGER, text TEXT, textId INTEGER)")
    names = {}
    for event in CHROME["traceEvents"]:
        if event.get("cat") != "kernel":
            continue
        sid = names.setdefault(event["name"], len(names) + 1)
        db.execute("INSERT OR IGNORE INTO StringIds VALUES (?, ?)", (sid, event["name"]))
        start = int(event["ts"] * 1000)
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, ?, ?)",
                   (start, start + int(event["dur"] * 1000), event["tid"], sid))  # fmt: skip
    db.execute("INSERT INTO StringIds VALUES (100, 'step 2')")
    for event in CHROME["traceEvents"]:
        if event.get("cat", "").endswith("user_annotation"):
            start = int(event["ts"] * 1000)
            name = "step 1" if event["name"] == "ProfilerStep#1" else event["name"]
            text, text_id = (None, 100) if event["name"] == "ProfilerStep#2" else (name, None)  # both spellings
            db.execute("INSERT INTO NVTX_EVENTS VALUES (?, ?, ?, ?)",
                       (start, start + int(event["dur"] * 1000), text, text_id))  # fmt: skip
    db.execute("INSERT INTO NVTX_EVENTS VALUES (5, NULL, 'a marker', NULL)")  # an instant: not a range
    db.commit()
    db.close()


def test_an_nsys_sqlite_export_gives_the_same_figures(tmp_path):
    path = tmp_path / "profile.sqlite"
    _nsys_export(path)
    steps = analyze(read_trace(str(path)))
    assert [s.name for s in steps] == ["step 1", "step 2"]
    steps[0].name, steps[1].name = "ProfilerStep#1", "ProfilerStep#2"
    _check_known_answer(steps)


def test_a_cpu_trace_uses_host_operators_and_a_trace_without_steps_is_one_step(tmp_path):
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 10},
        {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "ts": 2, "dur": 3},  # nested in aten::mm
        {"ph": "X", "cat": "cpu_op", "name": "gloo:all_to_all", "ts": 8, "dur": 6},
        {"ph": "X", "cat": "cpu_op", "name": "c10d::alltoall_base_", "ts": 12, "dur": 4},
    ]
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(events))  # a bare event list is a Chrome trace too
    trace = read_trace(str(path))
    assert not trace.device
    (step,) = analyze(trace)
    assert step.name == "whole trace"
    got = (step.total.comm_s, step.total.compute_s, step.total.concurrent_s)
    assert got == pytest.approx((8 * US, 10 * US, 2 * US))
    # With gloo's work spans (its worker thread) in the trace, they are the transfer and c10d:: only launches it.
    events.append({"ph": "X", "cat": "user_annotation", "name": "gloo:all_to_all", "ts": 3, "dur": 20, "tid": 9})
    path.write_text(json.dumps(events))
    (step,) = analyze(read_trace(str(path)))
    got = (step.total.comm_s, step.total.compute_s, step.total.concurrent_s)
    assert got == pytest.approx((20 * US, 10 * US, 7 * US))


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=60)


def test_two_traces_print_side_by_side_with_the_differences(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(CHROME))
    slower = json.loads(json.dumps(CHROME))
    for event in slower["traceEvents"]:
        if event.get("name") == "sm90_xmma_gemm":
            event["ts"] = 150  # the GEMM no longer beside the dispatch: 0 us concurrent in step 2
            event["dur"] = 50
    b.write_text(json.dumps(slower))
    run = _run(str(a), str(b))
    assert run.returncode == 0, run.stderr
    assert (
        "ProfilerStep#1: comm 0.040 ms, compute 0.060 ms, concurrent 0.020 ms, exposed comm 0.020 ms, "
        "concurrent fraction 50.00%" in run.stdout
    )
    assert "in ep_overlap/F.combine/L*/mb*: comm 0.020 ms" in run.stdout
    assert "1     concurrent ms             0.030        0.000       -0.030" in run.stdout


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "empty; give a torch-profiler trace or an nsys SQLite export"),
        (b"{not json", "not a Chrome trace (JSON:"),
        (b'{"traceEvents": 3}', "no traceEvents list"),
        (b'{"traceEvents": []}', "no kernel or operator in the trace"),
        (json.dumps({"traceEvents": [_kernel("gemm", 0, 5, 1)]}).encode(), "no communication in 1 activities"),
        (json.dumps({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": "x", "dur": 1}]}).encode(),
         "an event's ts or dur is not a number"),
    ],
)  # fmt: skip
def test_a_trace_it_cannot_use_gets_one_line_and_status_2(tmp_path, content, message):
    path = tmp_path / "t.json"
    path.write_bytes(content)
    run = _run(str(path))
    assert run.returncode == 2 and run.stdout == ""
    (line,) = run.stderr.splitlines()
    assert line.startswith(f"error: {path}: ") and message in line, line


def test_a_missing_file_and_a_foreign_sqlite_file_are_named(tmp_path):
    run = _run(str(tmp_path / "nope.json"))
    assert run.returncode == 2 and "cannot be read (No such file or directory)" in run.stderr
    other = tmp_path / "other.sqlite"
    sqlite3.connect(other).execute("CREATE TABLE t (x)").connection.commit()
    run = _run(str(other))
    assert run.returncode == 2 and "without CUPTI_ACTIVITY_KIND_KERNEL" in run.stderr


def test_a_range_row_counts_the_compute_inside_the_range_only(tmp_path):
    """Probe case: a 0.4 ms range reported the step's whole compute (0.470 ms); inside it there is 0.150 ms."""
    events = [
        _range("ProfilerStep#1", 0, 1000),
        _kernel("gemm", 0, 470, 7),  # compute before and inside the range
        _kernel("ncclDevKernel_AllToAll", 320, 400, 9),
        _range("ep_overlap/F.combine/L0/mb0", 320, 400, "gpu_user_annotation"),
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    (step,) = analyze(read_trace(str(path)))
    row = step.by_range["ep_overlap/F.combine/L*/mb*"]
    assert (row.comm_s, row.compute_s, row.concurrent_s) == pytest.approx((400 * US, 150 * US, 150 * US))
    assert step.total.compute_s == pytest.approx(470 * US)


def _copies_chrome() -> dict:
    events = json.loads(json.dumps(CHROME))["traceEvents"]
    events += [
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 60, "dur": 20, "pid": 0, "tid": 11},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": 75, "dur": 10, "pid": 0, "tid": 11},
    ]
    return {"traceEvents": events}


def test_copies_are_a_figure_of_their_own_in_both_formats(tmp_path):
    """Probe case: a Chrome trace counted gpu_memcpy as compute and the SQLite reader ignored copies. Copies at
    [60, 85) in step 1: 25 us of copies, and the compute and concurrent figures stay the constructed ones."""
    chrome = tmp_path / "t.json"
    chrome.write_text(json.dumps(_copies_chrome()))
    sqlite_path = tmp_path / "t.sqlite"
    _nsys_export(sqlite_path)
    db = sqlite3.connect(sqlite_path)
    db.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INTEGER, end INTEGER)")
    db.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_MEMSET (start INTEGER, end INTEGER)")
    db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY VALUES (60000, 80000)")
    db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_MEMSET VALUES (75000, 85000)")
    db.commit()
    db.close()
    for path in (chrome, sqlite_path):
        steps = analyze(read_trace(str(path)))
        steps[0].name, steps[1].name = "ProfilerStep#1", "ProfilerStep#2"
        _check_known_answer(steps)
        assert steps[0].total.copy_s == pytest.approx(25 * US) and steps[1].total.copy_s == 0.0
    run = _run(str(chrome))
    assert run.returncode == 0 and "copies 0.025 ms" in run.stdout


@pytest.mark.parametrize(
    "ts, dur", [(float("nan"), 5), (0, -3), (float("inf"), 1)], ids=["nan-ts", "negative-dur", "inf-ts"]
)
def test_an_event_with_a_broken_time_is_refused_not_dropped(tmp_path, ts, dur):
    events = [_kernel("ncclDevKernel_AllToAll", 0, 10, 9), _kernel("gemm", ts, dur, 7)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))  # json writes NaN and Infinity, as Python reads them
    run = _run(str(path))
    assert run.returncode == 2 and run.stdout == "", run.stdout
    (line,) = run.stderr.splitlines()
    assert "the event 'gemm' has start" in line and "fix: " in line


def test_a_truncated_gz_trace_gets_one_line_and_status_2(tmp_path):
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(json.dumps(CHROME).encode())[:-30])
    run = _run(str(path))
    assert run.returncode == 2 and run.stdout == ""
    (line,) = run.stderr.splitlines()
    assert "not a Chrome trace (gzip:" in line


def test_the_work_is_linear_in_events_not_steps_times_events(monkeypatch):
    """Probe case: 500k events and 500 steps took 115 s (each step clipped every event). Counted, not timed: the
    intervals the step windows visit stay within a few times the events, however many steps there are."""
    import utils.trace_overlap as trace_overlap

    visited = []
    original = trace_overlap.clip
    monkeypatch.setattr(
        trace_overlap, "clip", lambda intervals, window: visited.append(len(intervals)) or original(intervals, window)
    )
    steps, per_step = 200, 20
    activities, ranges = [], []
    for k in range(steps):
        base = 100.0 * k
        ranges.append(trace_overlap.Activity(f"ProfilerStep#{k}", base, base + 100))
        ranges.append(trace_overlap.Activity("ep_overlap/F.dispatch/L0/mb0", base + 10, base + 20))
        for i in range(per_step):
            name = "nccl_all_to_all" if i % 2 else "gemm"
            activities.append(trace_overlap.Activity(name, base + 4.0 * i, base + 4.0 * i + 3))
    result = analyze(trace_overlap.Trace("synthetic", activities, ranges))
    assert len(result) == steps
    assert sum(visited) <= 4 * len(activities) + 4 * len(ranges), sum(visited)
