"""``tools/recipe_check.py``'s own handling, in seconds: its worker is ``recipe_check/fake_worker.py`` (no scratch
venv, no Bridge; each run forks two sleeping ranks). A name that is no MoE recipe with expert parallelism, a name
given twice, an output path that cannot be written, SIGINT or SIGTERM in the middle of a run, and ``--resume``.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAKE = ROOT / "tests" / "functional_tests" / "recipe_check" / "fake_worker.py"
MOE = [f"perf_recipes.moe_{i}_pretrain_config" for i in range(3)]
DENSE = "recipes.llama3_8b_pretrain_config"


def _universe() -> list[dict]:
    """What the real worker's ``--universe`` says of three MoE recipes with EP > 1 and one dense recipe."""
    moe = [{"recipe": name, "family": "qwen3_moe", "built": True, "moe_ep": True, "config": [], "setting": "on",
            "recipe_shape": "EP8 4 layers", "gpu": {"verdict": "runs"}, "shape": "EP2 2 layers", "ranks": 2,
            "substituted": [], "needs_patch": False, "key": f"key{i}"} for i, name in enumerate(MOE)]  # fmt: skip
    return moe + [{"recipe": DENSE, "family": "llama", "built": True, "moe_ep": False, "config": []}]


class Fake:
    def __init__(self, tmp_path: Path):
        self.tmp, self.log, self.config = tmp_path / "tmp", tmp_path / "fake.log", tmp_path / "fake.json"
        self.tmp.mkdir()
        self.slow()
        self.env = os.environ | {"RECIPE_CHECK_FAKE": str(self.config), "TMPDIR": str(self.tmp)}

    def slow(self, *names: str) -> None:
        self.config.write_text(json.dumps({"universe": _universe(), "slow": names, "log": str(self.log)}))

    def command(self, *args: str) -> list[str]:
        return [sys.executable, str(FAKE), "--check", *args]

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(*args), capture_output=True, text=True, timeout=120, env=self.env, cwd=ROOT)

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []

    def runs(self) -> list[list[str]]:
        """The names of each ``--recipes`` worker the check started."""
        return [r["names"] for r in self.records() if r.get("worker") == "--recipes"]

    def pids(self) -> list[int]:
        """Every worker and rank started."""
        return [pid for r in self.records() for pid in ([r["pid"]] if "pid" in r else r.get("ranks", []))]


@pytest.fixture
def fake(tmp_path):
    fake = Fake(tmp_path)
    yield fake
    for pid in fake.pids():  # what a failing check left behind
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Running, or a zombie: the check reaps what it started (its ranks become its children once their worker is
    stopped), so none is left for an init that may not reap."""
    return Path(f"/proc/{pid}").exists()


def _interrupted(fake: Fake, signum: int, *args: str) -> tuple[subprocess.Popen, str, str, float]:
    """The check on MOE (the last one slow), stopped by ``signum`` once two rows are in: it, its stdout and stderr,
    and the seconds from the signal to its exit."""
    proc = subprocess.Popen(fake.command(*MOE, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=fake.env, cwd=ROOT)  # fmt: skip
    err, two_rows = [], threading.Event()

    def read() -> None:
        for line in proc.stderr:
            err.append(line)
            two_rows.set() if line.startswith("[2/3,") else None

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert two_rows.wait(60), "".join(err)
    deadline = time.monotonic() + 10
    while len(fake.pids()) < 2 + 3 * 2 and time.monotonic() < deadline:  # 2 workers; 3 runs' ranks (the slow one's)
        time.sleep(0.05)
    assert len(fake.runs()) == 1 and len(fake.pids()) == 2 + 3 * 2, fake.records()
    os.kill(proc.pid, signum)
    sent = time.monotonic()
    out = proc.stdout.read()
    proc.wait(timeout=30)
    seconds = time.monotonic() - sent
    reader.join(10)
    return proc, out, "".join(err), seconds


def test_a_recipe_with_no_moe_and_ep_is_one_line_and_exit_2(fake, tmp_path):
    run = fake.run(MOE[0], "llama3_8b_pretrain_config")
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        f"error: {DENSE}: builds no MoE model with expert_model_parallel_size above 1: the overlap has nothing to "
        "overlap there; fix: a name from `python tools/recipe_check.py --list`"
    ]
    assert fake.runs() == []  # refused before any run


def test_a_name_given_twice_runs_once(fake, tmp_path):
    run = fake.run(MOE[0], MOE[0].split(".", 1)[1], MOE[1], MOE[0], "--json", str(tmp_path / "rows.json"))
    assert run.returncode == 0, run.stderr
    assert "2 configs, 2 runs" in run.stdout.splitlines() and run.stdout.count(f"`{MOE[0]}`") == 1, run.stdout
    assert fake.runs() == [MOE[:2]]
    blob = json.loads((tmp_path / "rows.json").read_text())
    assert [row["recipe"] for row in blob["rows"]] == MOE[:2] and not blob["partial"]


def test_an_output_path_that_cannot_be_written_is_refused_before_the_first_run(fake, tmp_path):
    run = fake.run(MOE[0], "--json", str(tmp_path / "missing" / "rows.json"), "--markdown", str(tmp_path))
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        f"error: --json {tmp_path}/missing/rows.json: the directory {tmp_path}/missing does not exist; fix: create "
        "it, or name another path",
        f"error: --markdown {tmp_path}: is a directory; fix: name a file",
    ]
    assert fake.records() == []  # not even the universe was built


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_run_stops_every_process_and_writes_the_finished_rows(fake, tmp_path, signum):
    fake.slow(MOE[2])
    rows = tmp_path / "rows.json"
    proc, out, err, seconds = _interrupted(fake, signum, "--json", str(rows), "--markdown", str(tmp_path / "t.md"))
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum, err
    assert seconds < 10, seconds
    assert err.strip().splitlines()[-1] == (
        f"interrupted by {name} after 2 of 3 configs (2 runs): their rows are above and in {rows} (partial); to go "
        f"on: python tools/recipe_check.py --resume {rows}"
    )
    assert "Traceback" not in err
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in fake.pids()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in fake.pids() if _alive(pid)]  # the worker and every rank, the slow run's included
    assert not list(fake.tmp.glob("recipe-check-*"))
    blob = json.loads(rows.read_text())
    assert blob["partial"] and (blob["finished"], blob["of"]) == (2, 3)
    assert [(row["recipe"], row["verdict"]) for row in blob["rows"]] == [(n, "bitwise") for n in MOE[:2]]
    for table in (out, (tmp_path / "t.md").read_text()):
        assert f"`{MOE[1]}`" in table and f"`{MOE[2]}`" not in table, table
        assert f"partial: interrupted by {name} after 2 of 3 configs (2 runs)" in table


def test_resume_runs_only_the_rows_the_file_lacks(fake, tmp_path):
    fake.slow(MOE[2])
    rows = tmp_path / "rows.json"
    assert _interrupted(fake, signal.SIGINT, "--json", str(rows))[0].returncode == 130
    fake.slow()
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    refused = fake.run("--resume", str(bad))
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert refused.stderr.startswith(f"error: --resume {bad}: not JSON (")
    assert len(fake.runs()) == 1
    run = fake.run("--resume", str(rows))  # the names and the output come from the file
    assert run.returncode == 0, run.stderr
    assert fake.runs()[1:] == [[MOE[2]]]
    blob = json.loads(rows.read_text())
    assert not blob["partial"] and [row["recipe"] for row in blob["rows"]] == MOE
    assert "3 configs, 3 runs" in run.stdout.splitlines()
