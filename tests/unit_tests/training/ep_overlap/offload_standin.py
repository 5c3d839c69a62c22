"""Test-only: Megatron-Core's fine-grained activation offloading on CPU ranks, counted. Never imported by product code.

Megatron-Core's offload manager (``pipeline_parallel/fine_grained_activation_offload.py``) manages CUDA tensors only
(``ChunkOffloadHandler._can_manage_tensor_for_offload``), copies them into pinned host memory, and asks Transformer
Engine's ``cpu_offload`` module for a flag while its saved-tensor hooks are on. So on CPU it offloads nothing, and no
test of who drives it could fail. Under :func:`install_offload_standin` (after ``mcore_cpu.install_cpu_stubs``, whose
no-op streams and events it uses): the manager manages CPU tensors as it would CUDA ones (parameters and fake tensors
still not), its host copies are unpinned (pinning needs a CUDA driver), and the flag is a plain namespace. Every copy
out and back in is counted by chunk handler (one per microbatch and model chunk, numbered in the order they were
made, which is the driver's forward order) and offload group name.
"""

from collections import Counter
from types import SimpleNamespace

import torch


class OffloadCounts:
    """Copies out (``offloads[(handler, group)]``) and back in (``reloads[handler]``) since the last :meth:`take`."""

    def __init__(self):
        self.offloads: Counter = Counter()
        self.reloads: Counter = Counter()

    def take(self) -> dict:
        """This step's counts (plain dicts), and a fresh start for the next."""
        taken = {"offloads": dict(self.offloads), "reloads": dict(self.reloads)}
        self.offloads.clear()
        self.reloads.clear()
        return taken


COUNTS = OffloadCounts()


def _handler_index(handler) -> int:
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import PipelineOffloadManager

    made = PipelineOffloadManager.get_instance()._cached_chunks_forward
    return next(i for i, h in enumerate(made) if h is handler)


def install_offload_standin() -> OffloadCounts:
    """Patches Megatron-Core's offload manager for this (forked test) process; returns the counts it keeps."""
    from megatron.core.extensions import transformer_engine
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as offload

    handler, pool = offload.ChunkOffloadHandler, offload.OffloadTensorPool

    def manageable(tensor) -> bool:
        stray = isinstance(
            tensor, (torch._subclasses.fake_tensor.FakeTensor, torch._subclasses.functional_tensor.FunctionalTensor)
        )
        return not isinstance(tensor, torch.nn.Parameter) and not stray and tensor.device.type in ("cuda", "cpu")

    handler._can_manage_tensor_for_offload = staticmethod(manageable)
    copy_out, copy_in, offload_group = handler.offload, handler.reload, handler.bulk_offload_group

    def bulk_offload_group(self, group):
        self._counted_group = group._name
        try:
            return offload_group(self, group)
        finally:
            self._counted_group = None

    def offload_unpinned(self, src_tensor, pin_memory=True, use_cpu_pool=True):
        COUNTS.offloads[(_handler_index(self), self._counted_group)] += 1
        return copy_out(self, src_tensor, pin_memory=False, use_cpu_pool=use_cpu_pool)

    def reload(self, state, non_blocking=None):
        COUNTS.reloads[_handler_index(self)] += 1
        return copy_in(self, state, non_blocking=non_blocking)

    handler.bulk_offload_group, handler.offload, handler.reload = bulk_offload_group, offload_unpinned, reload
    pool_init = pool.__init__
    pool.__init__ = lambda self, device="cuda", pin_memory=False: pool_init(self, device=device, pin_memory=False)
    if transformer_engine.cpu_offload is None:  # the flag Transformer Engine's own modules read; none here
        transformer_engine.cpu_offload = SimpleNamespace(CPUOffloadEnabled=False)
    return COUNTS


def fresh_offload_manager() -> None:
    """A new manager for a new arm (Megatron-Core keeps one per process; its first step records the groups)."""
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import PipelineOffloadManager

    PipelineOffloadManager.reset_instance()
    COUNTS.take()
