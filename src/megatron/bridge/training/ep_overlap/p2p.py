"""Pipeline P2P for the engine: activations forward and gradients backward between pipeline ranks.

Contract:
    * Every transfer is one tagged message on the gloo ``pp_group`` (tags from
      :meth:`~megatron.bridge.training.ep_overlap.pipeline.Transfer.tag`, unique within a step), so the order in
      which the two ends post their halves does not matter. CUDA tensors go through host memory.
    * ``send`` is asynchronous and never blocks; all sends of a step are waited for at its end (``finish``).
      ``post`` posts receives (the driver posts one step ahead); ``take`` returns a :class:`Pending` that waits
      for the data where it is consumed. Every wait runs under the groups' timeout and raises
      :class:`CollectiveError` naming this rank, the transfer and the peer.
    * Each transfer is recorded on the step's lane as a comm record (``p2p_recv``/``p2p_send`` with ``F`` or
      ``B``), from posting until its wait returned (gloo's P2P work has no completion callback), so the report
      can show P2P time apart from all-to-all time; the part no compute covers is the host waiting on it.
"""

import time

import torch
import torch.distributed as dist

from megatron.bridge.training.ep_overlap.lanes import Pending
from megatron.bridge.training.ep_overlap.pipeline import FORWARD, Transfer
from megatron.bridge.utils.process_groups import EPGroups, wait_work


class PipelineP2P:
    """Tagged asynchronous P2P for one training step on one rank."""

    def __init__(self, groups: EPGroups, lane, num_chunks: int, device: torch.device):
        self.groups, self.lane, self.num_chunks, self.device = groups, lane, num_chunks, device
        self._recvs: dict[Transfer, tuple[dist.Work, torch.Tensor, object]] = {}
        self._sends: list[tuple[dist.Work, Transfer, torch.Tensor, object]] = []

    def _name(self, transfer: Transfer, verb: str) -> str:
        what = "activation" if transfer.kind == FORWARD else "gradient"
        return (
            f"pipeline {verb} of the {what} of microbatch {transfer.microbatch}, chunk {transfer.chunk} "
            f"({'from' if verb == 'receive' else 'to'} pipeline rank {transfer.peer}, "
            f"global rank {self.groups.pp_ranks[transfer.peer]})"
        )

    def _record(self, op: str, transfer: Transfer, nbytes: tuple[int, int]):
        op = f"{op}_{transfer.kind}"
        return self.lane.record_comm(op, -1, transfer.microbatch, exchanged=nbytes)

    def post(self, transfers: tuple[Transfer, ...], shape_of, dtype: torch.dtype) -> None:
        """Posts the receives of ``transfers`` not posted yet; ``shape_of(transfer)`` gives each tensor's shape."""
        for transfer in transfers:
            if transfer in self._recvs:
                continue
            buffer = torch.empty(shape_of(transfer), dtype=dtype)
            record = self._record("p2p_recv", transfer, (0, buffer.numel() * buffer.element_size()))
            work = dist.irecv(
                buffer,
                src=self.groups.pp_ranks[transfer.peer],
                group=self.groups.pp_group,
                tag=transfer.tag(self.num_chunks),
            )
            self._recvs[transfer] = (work, buffer, record)

    def take(self, transfer: Transfer) -> Pending:
        """The posted receive of ``transfer``; its ``wait()`` yields the tensor on this rank's device."""
        work, buffer, record = self._recvs.pop(transfer)

        def wait() -> None:
            wait_work(work, op=self._name(transfer, "receive"), timeout=self.groups.timeout)
            if record.done is None:
                record.done = self.lane.recorder.clock.mark()

        return Pending(buffer, wait, record, convert=lambda host: host.to(self.device))

    def send(self, transfer: Transfer, tensor: torch.Tensor) -> None:
        """Starts sending ``tensor`` (detached; staged through host memory) and returns at once."""
        payload = tensor.detach().to("cpu").contiguous()
        record = self._record("p2p_send", transfer, (payload.numel() * payload.element_size(), 0))
        work = dist.isend(
            payload,
            dst=self.groups.pp_ranks[transfer.peer],
            group=self.groups.pp_group,
            tag=transfer.tag(self.num_chunks),
        )
        self._sends.append((work, transfer, payload, record))

    def finish(self) -> None:
        """Waits for every send of the step; any receive still posted is a schedule error."""
        for work, transfer, _, record in self._sends:
            record.wait_start_host = time.perf_counter()
            wait_work(work, op=self._name(transfer, "send"), timeout=self.groups.timeout)
            record.done, record.wait_end_host = self.lane.recorder.clock.mark(), time.perf_counter()
        self._sends.clear()
        if self._recvs:
            left = ", ".join(self._name(t, "receive") for t in self._recvs)
            raise RuntimeError(f"posted but never consumed: {left}")
