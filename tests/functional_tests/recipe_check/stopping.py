"""Test-only: how the recipe check stops. SIGINT and SIGTERM become :class:`Interrupted` in the check's own process;
each worker it starts leads a process group of its own (``stock_bridge.start``), and its ranks are forked into that
group, so :func:`stop_group` ends a worker and every rank it started at once, wherever the worker was.

The terminal's Ctrl-C reaches only the check (the workers are in their own groups); the check stops them itself. On
Linux the check is its descendants' subreaper: a rank whose worker was stopped first is reaped by the check, not left
as a zombie under an init that does not reap (as in some containers).
"""

import contextlib
import ctypes
import os
import signal
import subprocess
import time

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_held = {"depth": 0, "pending": None}  # inside held(): a signal waits for its end


class Interrupted(BaseException):
    """The check was asked to stop: ``status`` is the exit status a shell gives that signal (130, 143)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.name = signal.Signals(signum).name
        self.status = 128 + signum


def _raise(signum, frame) -> None:
    for each in SIGNALS:  # a second signal must not cut the cleanup short
        signal.signal(each, signal.SIG_IGN)
    if _held["depth"]:
        _held["pending"] = signum
        return
    raise Interrupted(signum)


@contextlib.contextmanager
def held():
    """A signal that comes inside waits for the end (e.g. until a started worker is on the list of those to stop)."""
    _held["depth"] += 1
    try:
        yield
    finally:
        _held["depth"] -= 1
        if not _held["depth"] and _held["pending"] is not None:
            signum, _held["pending"] = _held["pending"], None
            raise Interrupted(signum)


def raise_on_signals() -> None:
    """From now on, SIGINT or SIGTERM raises :class:`Interrupted` (once; later ones are ignored)."""
    for each in SIGNALS:
        signal.signal(each, _raise)


def adopt_orphans() -> None:
    """Linux: the orphans of this process's descendants become its children (``PR_SET_CHILD_SUBREAPER``)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: init reaps them
        pass


def reap_orphans(wait_s: float = 2.0) -> None:
    """Reaps every child left (call once the workers are stopped and reaped): waits up to ``wait_s`` for those just
    killed to exit."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # none left
            return
        if pid == 0:
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)


def stop_group(process: subprocess.Popen, grace_s: float = 1.0) -> None:
    """``process`` and everything in its process group: SIGTERM, then, after at most ``grace_s`` for the leader to
    exit, SIGKILL to the whole group (ranks a worker left behind included). Reaps ``process``."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:  # no such group: the process is gone, or it does not lead one
        if process.poll() is None:
            process.kill()
    deadline = time.monotonic() + grace_s
    while process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
