"""Test-only: the activation memory of a steady training step under this project's plan (the pre-wrap hook) and
under Megatron-Core's own combined-1F1B plan (the control), on the same model. A measurement, run as

    python -m tests.unit_tests.training.ep_overlap.activation_memory [--full] [--emulated]

``--emulated``: both plans on their CUDA paths under the CUDA emulation (``cuda_emulation.py``): Megatron-Core's
combine on its comm stream, ours on the ``CudaLane``, each freeing what its CUDA path frees.

The steps after the first two are measured, each with Python's garbage collector off (so nothing the step leaves as
cyclic garbage is released for it): the peak, over the step, of the bytes in blocks the CPU allocator handed out
since the step began (``torch.profiler``'s memory events, :func:`allocated_peak`); the least of those peaks is kept.
``gc_found`` lists this project's (``megatron.bridge.training.ep_overlap``) objects that ``gc.collect()`` finds
unreachable after each step.
"""

import gc
import sys
from contextlib import contextmanager
from dataclasses import dataclass, replace
from types import FunctionType

import torch

from .local_ranks import run_local_ranks
from .mcore_models import McoreCase

OURS = "megatron.bridge.training.ep_overlap"
WARMUP = 2  # steps before the measured ones


@dataclass(frozen=True)
class MemoryCase:
    """8 experts on EP 2 (4 local), top-2, 2 MoE layers; ``pipeline``: PP 2 x VPP 2 (4 ranks); ``emulated``: under
    the CUDA emulation."""

    microbatches: int = 4
    dispatcher: str = "alltoall"
    pipeline: bool = False
    emulated: bool = False

    @property
    def mcore(self) -> McoreCase:
        return McoreCase(
            microbatches=self.microbatches,
            steps=WARMUP + 3,
            dispatcher=self.dispatcher,
            layer_freq=(1,) * (4 if self.pipeline else 2),
            config=(("num_moe_experts", 8),),
        )

    @property
    def ranks(self) -> int:
        return 4 if self.pipeline else 2

    def __str__(self) -> str:
        where = " emulated" if self.emulated else ""
        return f"{self.dispatcher} {'PP2xVPP2' if self.pipeline else 'PP1'} N={self.microbatches}{where}"


def _allocations(nodes):
    from torch._C._profiler import _EventType

    for node in nodes:
        if node.tag == _EventType.Allocation:
            yield node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size
        yield from _allocations(node.children)


def allocated_peak(prof) -> int:
    """The peak of the bytes in blocks allocated since the profile began (the CPU allocator's events). A block that
    gloo's threads free (an all-to-all's last reference) goes unrecorded: it counts as freed when its address is
    handed out again."""
    live, total, peak = {}, 0, 0
    for _, ptr, size in sorted(_allocations(prof.profiler.kineto_results.experimental_event_tree())):
        total -= live.pop(ptr, 0)
        if size > 0:
            live[ptr] = size
            total += size
        peak = max(peak, total)
    return peak


def ours_found_by_gc() -> list[str]:
    """The types of this project's objects that ``gc.collect()`` finds unreachable now (they are then freed)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = [type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith(OURS)]
        found += [o.__qualname__ for o in gc.garbage if isinstance(o, FunctionType) and o.__module__.startswith(OURS)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return sorted(found)


def _measure(rank: int, world: int, case: MemoryCase, arms: tuple) -> dict:
    from .fake_deepep import install_fake_deepep
    from .mcore_arms import run_arm
    from .mcore_cpu import init_megatron, install_cpu_stubs

    if case.emulated:
        from .emulated_arms import emulate

        emulate()
    else:
        install_cpu_stubs()
    if case.dispatcher == "flex":
        install_fake_deepep()
    mcore = case.mcore
    init_megatron(mcore.world, 2 if case.pipeline else 1, 2 if case.pipeline else None)
    out = {}
    for arm in arms:
        peaks, found, step = [], [], iter(range(mcore.steps))

        @contextmanager
        def around(peaks=peaks, found=found, step=step):
            if next(step) < WARMUP:
                yield
                return
            gc.collect()
            gc.disable()
            try:
                with torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
                ) as p:
                    yield
                found.extend(ours_found_by_gc())
            finally:
                gc.enable()
            peaks.append(allocated_peak(p))

        result = run_arm(arm, mcore, pipeline=case.pipeline, around_step=around)
        out[arm] = {"allocated": min(peaks), "gc_found": found, "losses": result["losses"]}
    return out


def measure(case: MemoryCase, arms: tuple = ("mcore", "hook")) -> list[dict]:
    """Per rank, per arm: ``allocated`` (bytes), ``gc_found`` and the steps' losses."""
    return [o.result for o in run_local_ranks(_measure, case.ranks, (case, arms), collective_timeout_s=120)]


MATRIX = [
    MemoryCase(n, dispatcher, pipeline)
    for dispatcher in ("alltoall", "flex")
    for pipeline in (False, True)
    for n in (2, 4, 8)
]


def main(cases) -> None:
    print(f"{'case':<26} {'ours (hook)':>20} {'Megatron-Core plan':>20}  ratio   ours found by gc")
    for case in cases:
        got = measure(case)
        ours = max(r["hook"]["allocated"] for r in got)
        theirs = max(r["mcore"]["allocated"] for r in got)
        found = sorted({t for r in got for t in r["hook"]["gc_found"]})
        print(f"{str(case):<26} {ours:>20,} {theirs:>20,}  {ours / theirs:5.2f}   {found[:4]}", flush=True)


if __name__ == "__main__":
    cases = MATRIX if "--full" in sys.argv else [replace(MemoryCase(), microbatches=n) for n in (2, 4, 8)]
    main([replace(case, emulated="--emulated" in sys.argv) for case in cases])
