"""Local ranks: no wall-clock cap, a stall or a dead rank is seen, progress survives, ranks die with the parent."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from megatron.bridge.utils.multiprocess import RankFailure, report_progress, run_local_ranks


def _steady_progress(rank: int, world: int, steps: int, pause: float) -> int:
    for step in range(steps):
        time.sleep(pause)
        report_progress({"step": step})
    return steps


def test_a_run_that_keeps_reporting_is_never_cut_short():
    # 3 s of work under a 1 s stall timeout: only silence counts, not duration.
    outcomes = run_local_ranks(_steady_progress, 2, (6, 0.5), stall_timeout_s=1.0)
    assert [o.result for o in outcomes] == [6, 6]


def _stall_after_two_steps(rank: int, world: int) -> None:
    _steady_progress(rank, world, 2, 0.0)
    time.sleep(60)


def test_silence_stops_the_run_and_keeps_what_was_reported():
    start = time.monotonic()
    with pytest.raises(RankFailure) as raised:
        run_local_ranks(_stall_after_two_steps, 2, (), stall_timeout_s=1.5)
    assert time.monotonic() - start < 10
    assert "no rank reported progress for 2 s (stall timeout 2 s)" in str(raised.value)
    assert raised.value.progress == {0: [{"step": 0}, {"step": 1}], 1: [{"step": 0}, {"step": 1}]}


def _die_quietly(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)
    time.sleep(60)


def test_a_rank_that_dies_without_a_word_is_seen_at_once():
    start = time.monotonic()
    outcomes = run_local_ranks(_die_quietly, 2, (), raise_on_error=False)
    assert time.monotonic() - start < 10
    assert "rank 1 died without reporting (exit code 3)" in outcomes[1].error


def test_ranks_die_with_their_parent():
    script = textwrap.dedent(
        f"""
        import os, sys, time
        sys.path.insert(0, {os.getcwd()!r})
        from megatron.bridge.utils.multiprocess import run_local_ranks

        def linger(rank, world):
            os.write(1, f"{{os.getpid()}}\\n".encode())  # one atomic write per rank
            time.sleep(120)

        run_local_ranks(linger, 2, ())
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids = []
    while len(pids) < 2:
        pids += [int(token) for token in parent.stdout.readline().split()]
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=10)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"  # a zombie has exited; only its parent's reaping is left
    except FileNotFoundError:
        return False
