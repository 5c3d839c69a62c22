"""The CPU lane that launches all-to-alls off the host thread (``launch_off_host``, the lab's engine on CPU).

Launches, and the ``splits()`` a dispatch first waits for, run on one helper thread in the order asked for: a dispatch
waiting for its split sizes no longer stops the host, which computes the other microbatch meanwhile, and one thread
keeps every rank's launch order the program order (how collectives match across ranks). ``splits()`` must touch
nothing the host uses meanwhile; a failed launch fails every later one, so none pairs with a wrong peer op.
"""

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from megatron.bridge.training.ep_overlap.runtime.lanes import CpuLane, Pending, Splits, make_lane
from megatron.bridge.training.ep_overlap.runtime.records import HostClock, StepRecorder
from megatron.bridge.utils.process_groups import CollectiveError, EPGroups, wait_error


class _LaunchedLater(Pending):
    """One of the all-to-alls of a launch job on the helper thread: ``wait()`` waits for the launch, then for it."""

    def __init__(self, job, index: int, name: str, timeout):
        super().__init__(None)
        self._job, self._index, self._name, self._timeout = job, index, name, timeout
        self._launched: Pending | None = None

    def wait(self) -> torch.Tensor:
        if self._launched is None:
            try:
                self._launched = self._job.result(timeout=self._timeout.total_seconds())[self._index]
            except FutureTimeout:
                raise wait_error(f"the launch of {self._name}", self._timeout, None) from None
        return self._launched.wait()


class OffHostCpuLane(CpuLane):
    """gloo async all-to-all, launched from one helper thread."""

    launches_off_host = True

    def __init__(self, groups: EPGroups, recorder: StepRecorder):
        super().__init__(groups, recorder)
        self._launcher = ThreadPoolExecutor(1, thread_name_prefix="ep-a2a-launch")
        self._failed: str | None = None
        self._last_job = None  # the launch job submitted last; the helper runs jobs in order

    def launch(self, splits: Splits, tensors: list[torch.Tensor], *, op: str, layer: int, microbatch: int):
        name = f"layer{layer} {op} (microbatch {microbatch})"
        asked = (self.recorder.phase, time.perf_counter())
        job = self._launcher.submit(self._launch_job, name, splits, tensors, op, layer, microbatch, asked)
        self._last_job = job
        return [_LaunchedLater(job, i, name, self.groups.timeout) for i in range(len(tensors))]

    def _launch_job(
        self, name: str, splits: Splits, tensors, op: str, layer: int, microbatch: int, asked: tuple[str, float]
    ):
        if self._failed is not None:
            raise CollectiveError(f"{name} not launched: {self._failed} failed")
        try:
            out_splits, in_splits = splits()
            return [self._start(t, out_splits, in_splits, op, layer, microbatch, asked) for t in tensors]
        except BaseException:
            self._failed = name
            raise

    def run_comm(self, fn: Callable[[], object], *, op: str, layer: int, microbatch: int) -> Pending:
        if self._last_job is not None:  # what the helper was asked to launch first goes out first, on every rank
            try:
                self._last_job.result(timeout=self.groups.timeout.total_seconds())
            except FutureTimeout:
                raise wait_error(f"the launches before layer{layer} {op}", self.groups.timeout, None) from None
        return super().run_comm(fn, op=op, layer=layer, microbatch=microbatch)

    def close(self, *, failed: bool = False) -> None:
        self._launcher.shutdown(wait=not failed and self._failed is None, cancel_futures=True)

    def all_to_all(
        self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], *, op: str, layer: int, microbatch: int
    ) -> Pending:
        if not self._helper_idle():
            return self.launch(lambda: (out_splits, in_splits), [x], op=op, layer=layer, microbatch=microbatch)[0]
        return super().all_to_all(x, out_splits, in_splits, op=op, layer=layer, microbatch=microbatch)

    def _helper_idle(self) -> bool:
        """Nothing queued, running or failed on the helper: the host may launch, in order, without waking it."""
        return self._failed is None and (self._last_job is None or self._last_job.done())


def lane_for(groups: EPGroups, device: torch.device, *, high_priority: bool = False, launch_off_host: bool = False):
    """The payload's lane for ``device`` (``make_lane``), or with ``launch_off_host`` on CPU with an EP group this
    one; a fresh recorder either way (one per step)."""
    if launch_off_host and device.type != "cuda" and groups.ep_group is not None:
        return OffHostCpuLane(groups, StepRecorder(clock=HostClock()))
    return make_lane(groups, device, high_priority=high_priority)
