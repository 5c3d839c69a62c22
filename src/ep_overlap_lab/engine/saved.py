"""Bytes of activations held for backward over one step on this rank: what a schedule costs in memory.

Contract:
    * Autograd's saved-tensor hooks see every tensor an op saves for its backward; a delayed weight gradient's
      queued work reports the tensors it keeps (``WeightGradStore.push(work, held=...)``). Each tensor counts by
      its storage, once however many views of it are held, from when it is saved or queued until the last holder
      lets it go (its backward ran, its graph was freed, or the queued wgrad ran).
    * Parameters (and views of them) are not activations and do not count.
    * A saved tensor whose storage a model frees until its backward needs it (``DiscardedStorage``) does not count
      while freed.
    * ``peak_bytes`` is the most held at any moment of the step; the count is exact and deterministic for given
      inputs, so tests may assert it. Transformer Engine's own delayed-wgrad buffers are not seen.
"""

import threading

import torch

from ep_overlap_lab.storage_count import Count
from ep_overlap_lab.wgrad_store import DiscardedStorage, WeightGradStore


class SavedActivations:
    """Counts what is held for backward while active (a context manager around a step's ops), in the planner's
    :class:`~ep_overlap_lab.planner.holds.Count` (the one count of bytes held).

    Args:
        parameters: The model's parameters, whose storages are never counted.
    """

    def __init__(self, parameters):
        self._parameters = {self._key(p) for p in parameters}
        self._lock = threading.Lock()
        self._count = Count()

    @property
    def current_bytes(self) -> int:
        return self._count.current

    @property
    def peak_bytes(self) -> int:
        return self._count.peak

    @staticmethod
    def _key(t: torch.Tensor) -> tuple:
        # The storage object itself (not its data pointer): stable while a tensor holds it, also when its data is
        # freed and rebuilt (DiscardedStorage), and never confused with a later allocation at the same address.
        return (t.device.type, t.device.index, t.untyped_storage()._cdata)

    def __enter__(self) -> "SavedActivations":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        WeightGradStore.observers.append(self)
        DiscardedStorage.observers.append(self)
        return self

    def __exit__(self, *exc) -> None:
        DiscardedStorage.observers.remove(self)
        WeightGradStore.observers.remove(self)
        self._hooks.__exit__(*exc)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether a tensor saved for backward (or queued for a wgrad) shares ``t``'s storage."""
        with self._lock:
            return bool(self._count.holders.get(self._key(t)))

    # ---- WeightGradStore observer -------------------------------------------------------------------

    def hold(self, tensors) -> None:
        for t in tensors:
            self._take(t)

    def release(self, tensors) -> None:
        for t in tensors:
            self._drop(self._key(t))

    # ---- DiscardedStorage observer ------------------------------------------------------------------

    def discard(self, t: torch.Tensor) -> tuple | None:
        key = self._key(t)
        with self._lock:
            return key if self._count.discard(key) else None

    def restore(self, key: tuple | None) -> None:
        if key is not None:
            with self._lock:
                self._count.restore(key)

    # ---- saved-tensor hooks -------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor):
        key = self._take(t)
        return t if key is None else _Held(t, key, self)

    @staticmethod
    def _unpack(packed) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Held) else packed

    def _take(self, t: torch.Tensor) -> tuple | None:
        key, nbytes = self._key(t), t.untyped_storage().nbytes()
        if key in self._parameters or not nbytes:
            return None
        with self._lock:
            self._count.hold(key, nbytes)
        return key

    def _drop(self, key: tuple) -> None:
        with self._lock:  # a key never taken (a parameter, an empty storage, before this count began) is no-one's
            self._count.release(key, missing_ok=True)


class _Held:
    """A saved tensor as autograd keeps it: when autograd lets it go, the count does too."""

    __slots__ = ("tensor", "key", "owner")

    def __init__(self, tensor: torch.Tensor, key: tuple, owner: SavedActivations):
        self.tensor, self.key, self.owner = tensor, key, owner

    def __del__(self) -> None:
        self.owner._drop(self.key)
