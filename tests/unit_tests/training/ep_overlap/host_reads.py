"""Test-only: a spy on what a training step reads on the host, and a stand-in for CUDA graph capture.

On a GPU these are the calls that wait for the device: a tensor's value read on the host (``item``, ``tolist``,
``cpu``, ``numpy``, its truth value or a Python number made of it) and the synchronize calls (``torch.cuda``'s, a
stream's, an event's, an event's ``query``). On a CPU host every tensor is a host tensor, so the spy counts each such
call on any tensor: the model's tensors are the ones that would live on the device. :func:`spy` records each call with
the line that made it; ``raising=True`` makes each one fail instead, as it would inside ``torch.cuda.graph`` capture
(:func:`capturing` also says so to code that asks ``torch.cuda.is_current_stream_capturing``).

Install after ``mcore_cpu.install_cpu_stubs`` (its stream and event stand-ins are what gets wrapped).
"""

import contextlib
import traceback

import torch

_TENSOR_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class HostRead(RuntimeError):
    """A host read inside a captured region (the capture stand-in)."""


def _where() -> str:
    """The innermost frame outside this file and torch: the line that asked."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not frame.filename.endswith("host_reads.py") and "/torch/" not in frame.filename:
            return f"{frame.filename.rsplit('/site-packages/', 1)[-1]}:{frame.lineno} {frame.name}"
    return "?"


@contextlib.contextmanager
def spy(raising: bool = False):
    """Records (or, ``raising``, refuses) every host read while the block runs; yields the list of records, each
    ``(call, where)``."""
    records: list[tuple[str, str]] = []
    saved = []

    def wrap(owner, name: str, label: str):
        original = getattr(owner, name, None)
        if original is None:
            return
        saved.append((owner, name, original))

        def spied(*args, **kwargs):
            where = _where()
            if raising:
                raise HostRead(f"{label} at {where} (not allowed while a CUDA graph is captured)")
            records.append((label, where))
            return original(*args, **kwargs)

        setattr(owner, name, spied)

    for name in _TENSOR_READS:
        wrap(torch.Tensor, name, f"Tensor.{name}")
    wrap(torch.cuda, "synchronize", "torch.cuda.synchronize")
    for owner in (torch.cuda.Stream, torch.cuda.Event):
        wrap(owner, "synchronize", f"{owner.__name__}.synchronize")
    wrap(torch.cuda.Event, "query", "Event.query")
    try:
        yield records
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


@contextlib.contextmanager
def capturing():
    """The capture stand-in: code sees a capture in progress, and any host read raises :class:`HostRead`."""
    asked = torch.cuda.is_current_stream_capturing
    torch.cuda.is_current_stream_capturing = lambda: True
    try:
        with spy(raising=True) as records:
            yield records
    finally:
        torch.cuda.is_current_stream_capturing = asked
