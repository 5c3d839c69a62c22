"""Pipeline P2P for the engine: activations forward and gradients backward between pipeline ranks.

Contract:
    * Every transfer is one tagged message on the gloo ``pp_group`` (tags from ``Transfer.tag`` of
      ``program/pipeline.py``, unique within a step), so the order in which the two ends post their halves does
      not matter. CUDA tensors go through host memory.
    * ``send`` is asynchronous and never blocks; all sends of a step are waited for at its end (``finish``).
      ``post`` posts receives (the driver posts one step ahead); ``take`` returns a :class:`Pending` that waits
      for the data where it is consumed. Every wait runs under the groups' timeout and raises
      :class:`CollectiveError` naming this rank, the transfer and the peer.
    * Each wait is recorded on the step's lane as a comm record (``p2p_recv``/``p2p_send`` with ``F`` or ``B``)
      from its start to its end: the time the host was blocked on P2P. gloo's P2P work has no completion
      callback, so time in flight behind compute is not observable and not recorded. The report shows P2P
      apart from all-to-all time.
"""

import time

import torch
import torch.distributed as dist

from ep_overlap_lab.program.pipeline import Transfer
from megatron.bridge.training.ep_overlap.program.pipeline import FORWARD
from megatron.bridge.training.ep_overlap.runtime.lanes import Pending
from megatron.bridge.utils.process_groups import EPGroups, wait_work


class PipelineP2P:
    """Tagged asynchronous P2P for one training step on one rank."""

    def __init__(self, groups: EPGroups, lane, num_chunks: int, device: torch.device):
        self.groups, self.lane, self.num_chunks, self.device = groups, lane, num_chunks, device
        self._recvs: dict[Transfer, tuple[dist.Work, torch.Tensor]] = {}
        self._sends: list[tuple[dist.Work, Transfer, torch.Tensor]] = []

    def _name(self, transfer: Transfer, verb: str) -> str:
        what = "activation" if transfer.kind == FORWARD else "gradient"
        return (
            f"pipeline {verb} of the {what} of microbatch {transfer.microbatch}, chunk {transfer.chunk} "
            f"({'from' if verb == 'receive' else 'to'} pipeline rank {transfer.peer}, "
            f"global rank {self.groups.pp_ranks[transfer.peer]})"
        )

    def _blocked(self, op: str, transfer: Transfer, nbytes: tuple[int, int], work: dist.Work, verb: str) -> None:
        """Waits for ``work``, recorded as a comm record from the wait's start to its end (zero when done)."""
        record = self.lane.record_comm(f"{op}_{transfer.kind}", -1, transfer.microbatch, exchanged=nbytes)
        record.wait_start_host = record.launch_host
        name = f"{op.removeprefix('p2p_')}_{'activation' if transfer.kind == FORWARD else 'gradient'}"
        with self.lane.ranged("p2p", name, -1, transfer.microbatch, role=transfer.kind):
            wait_work(work, op=self._name(transfer, verb), timeout=self.groups.timeout, polled=False)
        record.done, record.wait_end_host = self.lane.recorder.clock.mark(), time.perf_counter()

    def post(self, transfers: tuple[Transfer, ...], shape_of, dtype: torch.dtype) -> None:
        """Posts the receives of ``transfers`` not posted yet; ``shape_of(transfer)`` gives each tensor's shape."""
        for transfer in transfers:
            if transfer in self._recvs:
                continue
            buffer = torch.empty(shape_of(transfer), dtype=dtype)
            work = dist.irecv(
                buffer,
                src=self.groups.pp_ranks[transfer.peer],
                group=self.groups.pp_group,
                tag=transfer.tag(self.num_chunks),
            )
            self._recvs[transfer] = (work, buffer)

    def take(self, transfer: Transfer) -> Pending:
        """The posted receive of ``transfer``; its ``wait()`` yields the tensor on this rank's device (the wait is
        recorded in the phase of the step that consumes it)."""
        work, buffer = self._recvs.pop(transfer)
        nbytes = (0, buffer.numel() * buffer.element_size())
        return _OnDevice(buffer, lambda: self._blocked("p2p_recv", transfer, nbytes, work, "receive"), self.device)

    def send(self, transfer: Transfer, tensor: torch.Tensor) -> None:
        """Starts sending ``tensor`` (detached; staged through host memory) and returns at once."""
        payload = tensor.detach().to("cpu").contiguous()
        work = dist.isend(
            payload,
            dst=self.groups.pp_ranks[transfer.peer],
            group=self.groups.pp_group,
            tag=transfer.tag(self.num_chunks),
        )
        self._sends.append((work, transfer, payload))

    def finish(self) -> None:
        """Waits for every send of the step; any receive still posted is a schedule error."""
        for work, transfer, payload in self._sends:
            self._blocked("p2p_send", transfer, (payload.numel() * payload.element_size(), 0), work, "send")
        self._sends.clear()
        if self._recvs:
            left = ", ".join(self._name(t, "receive") for t in self._recvs)
            raise RuntimeError(f"posted but never consumed: {left}")


class _OnDevice(Pending):
    """A posted receive staged through host memory: ``wait()`` yields it on ``device`` (moved once)."""

    def __init__(self, host: torch.Tensor, wait_fn, device: torch.device):
        super().__init__(host, wait_fn)
        self._device = device

    def wait(self) -> torch.Tensor:
        arriving = self._wait_fn is not None
        out = super().wait()
        if arriving:
            self._out = out = out.to(self._device)
        return out
