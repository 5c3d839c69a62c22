"""Local ranks: no wall-clock cap, a stall or a dead rank is seen, progress survives, ranks die with the parent."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ep_overlap_lab.multiprocess import RankFailure, report_progress, run_local_ranks


def _steady_progress(rank: int, world: int, steps: int, pause: float) -> int:
    for step in range(steps):
        time.sleep(pause)
        report_progress({"step": step})
    return steps


def test_a_run_that_keeps_reporting_is_never_cut_short():
    # 5 s of work under a 2.5 s stall timeout: only silence counts, not duration. A report every 0.5 s leaves 2 s of
    # margin for a loaded machine (a 1 s timeout failed under load).
    outcomes = run_local_ranks(_steady_progress, 2, (10, 0.5), stall_timeout_s=2.5)
    assert [o.result for o in outcomes] == [10, 10]


def _slow_start(rank: int) -> None:
    time.sleep(2.0)  # heavy imports, a slow rendezvous: before the process group is up


def test_start_up_is_not_silence():
    # The stall clock runs once every rank's process group is up: 2 s of start-up under a 1.5 s stall timeout.
    outcomes = run_local_ranks(_steady_progress, 2, (2, 0.1), stall_timeout_s=1.5, rank_setup=_slow_start)
    assert [o.result for o in outcomes] == [2, 2]


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
        from ep_overlap_lab.multiprocess import run_local_ranks

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


def _killed(rank: int, world: int, after_error: bool) -> None:
    import torch
    import torch.distributed as dist

    if rank == 0 and after_error:
        raise ValueError("rank 0 failed first")
    if rank == 1:
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's OOM killer does
    dist.all_reduce(torch.ones(1))  # rank 0 waits for a peer that is gone


@pytest.mark.parametrize("after_error", [False, True])
def test_a_killed_rank_is_seen_within_a_second_and_reported_first_with_its_signal(after_error):
    start = time.monotonic()
    with pytest.raises(RankFailure) as raised:
        run_local_ranks(_killed, 2, (after_error,), collective_timeout_s=60)
    assert time.monotonic() - start < 1.0 + 1.0 + 4  # its death, a second for the others' reasons, start-up
    failure = raised.value
    assert failure.first[0] == 1 and failure.outcomes[1].error == "rank 1 was killed by SIGKILL (out of memory?)"
    assert str(failure).split("\n")[1:3] == ["--- rank 1 ---", "rank 1 was killed by SIGKILL (out of memory?)"]


def _long_step_with_heartbeats(rank: int, world: int) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from ep_overlap_lab.collectives import all_reduce

    # One "step" of about 3 s made of many short collectives, under a 1 s stall timeout, with no report_progress.
    start = time.monotonic()
    for count in range(150):
        all_reduce(torch.ones(1), dist.group.WORLD, op=f"collective {count}", timeout=timedelta(seconds=30))
        time.sleep(0.02)
    return time.monotonic() - start


def test_a_long_step_that_keeps_finishing_collectives_is_never_taken_for_a_stall():
    outcomes = run_local_ranks(_long_step_with_heartbeats, 2, (), stall_timeout_s=1.0)
    assert all(o.result > 2.0 for o in outcomes)


def _stall_after_a_collective(rank: int, world: int) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from ep_overlap_lab.collectives import all_reduce

    all_reduce(torch.ones(1), dist.group.WORLD, op="the last collective", timeout=timedelta(seconds=30))
    time.sleep(60)


def test_a_real_stall_is_still_caught_and_names_what_each_rank_last_finished():
    with pytest.raises(RankFailure) as raised:
        run_local_ranks(_stall_after_a_collective, 2, (), stall_timeout_s=1.5)
    assert "no rank reported progress for 2 s (stall timeout 2 s); this rank last finished the last collective" in str(
        raised.value
    )


def test_a_stopped_rank_ends_quietly_whatever_sigterm_handler_the_parent_has():
    # A launcher that turns SIGTERM into an exception (the harness does) must not pass that on to its ranks: the
    # rank would raise wherever it is, and inside a __del__ Python prints "Exception ignored" and goes on.
    script = textwrap.dedent(
        f"""
        import signal, sys, time
        sys.path.insert(0, {os.getcwd()!r})
        from ep_overlap_lab.multiprocess import run_local_ranks

        class SlowToCollect:
            def __del__(self):
                time.sleep(0.05)  # where the signal lands

        def fail_while_a_peer_collects(rank, world):
            if rank == 1:
                raise ValueError("rank 1 failed")
            while True:
                SlowToCollect()

        def stop(signum, frame):
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, stop)
        outcomes = run_local_ranks(fail_while_a_peer_collects, 2, (), collective_timeout_s=1, raise_on_error=False)
        print(outcomes[0].error)
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.stdout == "rank 0: stopped when another rank failed\n"
    assert run.stderr == ""
