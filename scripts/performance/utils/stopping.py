"""How the harness stops: SIGINT and SIGTERM both unwind through every cleanup (ranks, network namespaces), whatever
the launcher left them as (a shell's background job inherits SIGINT ignored). No torch here: the harness sets them
before its imports."""

import contextlib
import signal
from collections.abc import Callable


def _stop_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C's KeyboardInterrupt


STOPPING = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: _stop_on_sigterm}
IGNORED = {signal.SIGINT: signal.SIG_IGN, signal.SIGTERM: signal.SIG_IGN}


def stopping_until(finished: Callable[[], bool]) -> dict:
    """:data:`STOPPING`, except that SIGINT is dropped once ``finished()``: every step ran, so stopping then would only
    lose the report. SIGTERM still stops."""

    def on_sigint(signum, frame) -> None:
        if not finished():
            signal.default_int_handler(signum, frame)

    return {**STOPPING, signal.SIGINT: on_sigint}


@contextlib.contextmanager
def signal_handlers(handlers: dict):
    """``handlers`` (signal -> handler) while inside; the previous ones after."""
    previous = {signum: signal.signal(signum, handler) for signum, handler in handlers.items()}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def stopped_by(exc: BaseException) -> tuple[int, str]:
    """The exit status and the signal's name for what :data:`STOPPING` raised (KeyboardInterrupt or SystemExit)."""
    code = 130 if isinstance(exc, KeyboardInterrupt) else int(exc.code or 1)
    return code, signal.Signals(code - 128).name if code > 128 else "an interrupt"
