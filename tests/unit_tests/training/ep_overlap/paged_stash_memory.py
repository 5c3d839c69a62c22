"""Test-only: the activation memory of a steady training step with and without paged stash, on the plain path and
under this project's plan (``test_paged_stash.py``'s model, two CPU ranks). Not a test: a measurement, run as

    python -m tests.unit_tests.training.ep_overlap.paged_stash_memory [--layers N] [buffer factor ...]

Per arm, the third step (the stash profiles in the first and allocates in the second) is measured two ways:

* held for backward: the bytes of what autograd saves (``engine/saved.py``'s ``SavedActivations``, each storage
  once), plus, with paged stash, what its tensors keep resident (not paged out, or reloaded) and its page buffers,
  at the peak of the step. Megatron-Core's stash hooks the experts' saves inside the outer count's hooks (the inner
  ``saved_tensors_hooks`` wins), so its manager's hooks are wrapped to count what it does not page;
* allocated: the peak, over the step, of the bytes the CPU allocator holds beyond what it held when the step began
  (``torch.profiler``'s memory events), plus the page buffers allocated in the step before. It also counts what the
  plan's nodes hold between their steps (inputs a node keeps for its gradient), which autograd does not save.
"""

import sys
import weakref
from contextlib import contextmanager
from functools import partial

import torch

from ep_overlap_lab.engine.saved import SavedActivations, _Held

from .local_ranks import run_local_ranks

ARMS = ("plain-off", "plain", "hook-off", "hook", "mcore-off", "mcore")


class _HeldForBackward(SavedActivations):
    """``SavedActivations`` plus what Megatron-Core's paged stash holds (see the module docstring); ``peak_total``."""

    def __init__(self, parameters, manager):
        super().__init__(parameters)
        self.manager, self.paged, self.peak_total = manager, weakref.WeakSet(), 0

    def __enter__(self):
        super().__enter__()
        from megatron.core.transformer.moe.paged_stash import PagedTensor

        manager, save, get = self.manager, self.manager.on_save_for_backward, self.manager.on_get_saved_tensor

        def on_save(t):
            packed = save(t)
            if isinstance(packed, PagedTensor):
                self.paged.add(packed)
            else:  # not paged: an activation held as autograd holds it
                packed = self._pack(packed)
            self.sample()
            return packed

        def on_get(packed):
            return packed.tensor if isinstance(packed, _Held) else get(packed)

        manager.on_save_for_backward, manager.on_get_saved_tensor = on_save, on_get
        for name in ("stash_paged_tensors", "reload_paged_tensors", "wait_for_stash_to_complete"):
            setattr(manager, name, self._sampled(getattr(manager, name)))
        return self

    def __exit__(self, *exc):
        for name in ("on_save_for_backward", "on_get_saved_tensor", "stash_paged_tensors", "reload_paged_tensors",
                     "wait_for_stash_to_complete"):  # fmt: skip
            vars(self.manager).pop(name, None)
        super().__exit__(*exc)

    def _sampled(self, method):
        def call(*args, **kwargs):
            out = method(*args, **kwargs)
            self.sample()
            return out

        return call

    def _take(self, t):
        key = super()._take(t)
        self.sample()
        return key

    def buffer_bytes(self) -> int:
        buffers = [b for by_hidden in (self.manager.stash_buffers or {}).values() for b in by_hidden.values()]
        return sum(b.cuda_buffer.nbytes + (0 if b.host_buffer is None else b.host_buffer.nbytes) for b in buffers)

    def sample(self) -> None:
        resident = {}
        for paged in list(self.paged):
            for t in (paged._tensor, paged._original_tensor):
                if t is not None:
                    resident[self._key(t)] = t.untyped_storage().nbytes()
        extra = sum(n for key, n in resident.items() if not self._count.holders.get(key))
        self.peak_total = max(self.peak_total, self._count.current + extra + self.buffer_bytes())


def _allocated_peak(prof) -> int:
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    total = peak = 0
    for _, nbytes in events:
        total += nbytes
        peak = max(peak, total)
    return peak


def _measure(rank: int, world: int, factor: float, layers: int) -> dict:
    from dataclasses import replace

    from .mcore_arms import run_arm
    from .mcore_cpu import init_megatron
    from .paged_stash_experts import fresh_stash_manager
    from .test_paged_stash import PP1, _install, _prepare

    case = replace(PP1, layer_freq=(1,) * layers)
    _install()
    init_megatron(world)
    out = {}
    for arm in ARMS:
        mode, _, variant = arm.partition("-")
        manager, models, seen = fresh_stash_manager(), [], {}
        step = iter(range(case.steps))

        @contextmanager
        def around(models=models, seen=seen, manager=manager, step=step):
            if next(step) < case.steps - 1:
                yield
                return
            params = [p for m in models for p in m.parameters()]
            with _HeldForBackward(params, manager) as held:
                with torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
                ) as p:
                    yield
            buffers = held.buffer_bytes()
            seen.update(held=held.peak_total, allocated=_allocated_peak(p) + buffers, buffers=buffers)

        prepare = partial(_prepare, models=models, stash=variant != "off", factor=factor)
        run_arm(mode, case, prepare=prepare, around_step=around)
        seen["overflow"] = None if manager.overflow is None else manager.overflow.item()
        out[arm] = seen
    return out


def main(factors: list[float], layers: int = 2) -> None:
    for factor in factors:
        outcomes = run_local_ranks(_measure, 2, (factor, layers))
        print(f"{layers} MoE layers, moe_paged_stash_buffer_size_factor_cuda={factor}; bytes, ranks 0 / 1")
        print(f"{'arm':<10} {'held for backward':>22} {'allocated':>22} {'of it page buffers':>22} overflow")
        for arm in ARMS:
            cells = [[o.result[arm][k] for o in outcomes] for k in ("held", "allocated", "buffers", "overflow")]
            print(f"{arm:<10} " + " ".join(f"{f'{a} / {b}':>22}" for a, b in cells[:3]) + f" {cells[3]}")


if __name__ == "__main__":
    args = sys.argv[1:]
    depth = int(args.pop(args.index("--layers") + 1)) if "--layers" in args else 2
    main([float(a) for a in args if a != "--layers"] or [1.5, 4.0], depth)
