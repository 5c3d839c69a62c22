"""The CPU lane that launches off the host: a launch waiting for its split sizes does not stop the host, every
rank's all-to-alls still pair in program order, only what queues behind a waiting launch wakes the helper, and
a failed launch fails the later ones at once."""

import threading
import time
from datetime import timedelta

import pytest
import torch

from ep_overlap_lab.engine import EPOverlapEngine
from ep_overlap_lab.engine.off_host_lane import lane_for
from ep_overlap_lab.moe_gpt import MoEGPTModel
from megatron.bridge.utils.process_groups import CollectiveError, EPGroups

from .local_ranks import init_ep_groups, run_local_ranks, single_process_groups
from .workers import Case

DELAY_S = 0.4


def _rows(rank: int, op: int, splits: list[int]) -> torch.Tensor:
    """Rows this rank sends in all-to-all ``op``: each row says (sender, op, destination)."""
    dest = torch.repeat_interleave(torch.arange(len(splits)), torch.tensor(splits))
    return torch.stack([torch.full_like(dest, rank), torch.full_like(dest, op), dest], dim=1).float()


def _arriving(rank: int, op: int, send_splits_of) -> torch.Tensor:
    """What ``rank`` receives in ``op``: from each sender in rank order, the rows addressed to it."""
    sent = [_rows(src, op, send_splits_of(src)) for src in range(2)]
    return torch.cat([rows[rows[:, 2] == rank] for rows in sent])


def _slow_then_fast(rank: int, world: int) -> dict:
    groups = init_ep_groups(2, timedelta(seconds=20))
    lane = lane_for(groups, torch.device("cpu"), launch_off_host=True)
    # rank r sends 1 + r + d rows to rank d in op 0, and 2 rows everywhere in op 1
    send0 = [1 + rank + d for d in range(world)]
    recv0 = [1 + s + rank for s in range(world)]

    def late_splits():  # the split sizes of op 0 take a while to be known, as a slower peer's would
        time.sleep(DELAY_S)
        return recv0, send0

    lane.recorder.phase = "paired"
    start = time.perf_counter()
    (first,) = lane.launch(late_splits, [_rows(rank, 0, send0)], op="dispatch", layer=0, microbatch=1)
    second = lane.all_to_all(_rows(rank, 1, [2, 2]), [2, 2], [2, 2], op="combine_bwd", layer=0, microbatch=0)
    host_free_after = time.perf_counter() - start
    lane.recorder.phase = "cooldown"
    got1, got0 = second.wait(), first.wait()
    lane.close()
    clock = lane.recorder.clock
    records = {
        r.op: (r.phase, r.launch_host - start, clock.seconds(r.launch) - (start - clock.t0))
        for r in lane.recorder.comm
    }
    return {"free_after": host_free_after, "got0": got0, "got1": got1, "records": records}


def test_a_launch_waiting_for_its_splits_leaves_the_host_free_and_keeps_the_order():
    outcomes = run_local_ranks(_slow_then_fast, 2)
    for rank, outcome in enumerate(outcomes):
        result = outcome.result
        assert result["free_after"] < DELAY_S / 2, "the host waited for the split sizes"
        # op 0 arrived whole from each sender, then op 1: the later launch did not overtake the earlier one
        assert torch.equal(result["got0"], _arriving(rank, 0, lambda src: [1 + src + d for d in range(2)]))
        assert torch.equal(result["got1"], _arriving(rank, 1, lambda src: [2, 2]))
        # each launch is recorded when the host asked for it (in that phase) and when it really went out
        phase, asked, launched = result["records"]["dispatch"]
        assert phase == "paired" and asked < DELAY_S / 2 and launched >= DELAY_S
        phase, asked, launched = result["records"]["combine_bwd"]
        assert phase == "paired" and asked < DELAY_S / 2 and launched >= DELAY_S


def _who_launches(rank: int, world: int) -> dict:
    from megatron.bridge.training.ep_overlap.runtime import lanes

    groups = init_ep_groups(2, timedelta(seconds=20))
    lane = lane_for(groups, torch.device("cpu"), launch_off_host=True)
    launched_by = []
    real = lanes.dist.all_to_all_single

    def noting_the_thread(*args, **kwargs):
        launched_by.append(threading.current_thread() is threading.main_thread())
        return real(*args, **kwargs)

    def late_splits():
        time.sleep(DELAY_S)
        return [2, 2], [2, 2]

    def rows(op: int) -> torch.Tensor:
        return _rows(rank, op, [2, 2])

    lanes.dist.all_to_all_single = noting_the_thread
    try:
        got = [lane.all_to_all(rows(0), [2, 2], [2, 2], op="combine_bwd", layer=0, microbatch=0).wait()]
        (waiting,) = lane.launch(late_splits, [rows(1)], op="dispatch", layer=0, microbatch=1)
        behind = lane.all_to_all(rows(2), [2, 2], [2, 2], op="dispatch_bwd", layer=0, microbatch=0)
        got += [waiting.wait(), behind.wait()]
        got.append(lane.all_to_all(rows(3), [2, 2], [2, 2], op="combine", layer=1, microbatch=1).wait())
        lane.close()
    finally:
        lanes.dist.all_to_all_single = real
    return {"on_host": launched_by, "got": got}


def test_with_nothing_queued_on_the_helper_an_all_to_all_goes_out_from_the_host():
    for rank, outcome in enumerate(run_local_ranks(_who_launches, 2)):
        # first: nothing ahead; then one waiting for its split sizes and one behind it; then nothing ahead again
        assert outcome.result["on_host"] == [True, False, False, True]
        for op, got in enumerate(outcome.result["got"]):
            assert torch.equal(got, _arriving(rank, op, lambda src: [2, 2]))


def _failed_launch(rank: int, world: int) -> dict:
    groups = init_ep_groups(2, timedelta(seconds=20))
    lane = lane_for(groups, torch.device("cpu"), launch_off_host=True)

    def no_splits():
        raise RuntimeError("the split sizes never came")

    (first,) = lane.launch(no_splits, [torch.zeros(2, 3)], op="dispatch", layer=1, microbatch=2)
    second = lane.all_to_all(torch.zeros(2, 3), [1, 1], [1, 1], op="combine", layer=1, microbatch=2)
    errors = []
    for pending in (first, second):
        with pytest.raises(Exception) as caught:
            pending.wait()
        errors.append(f"{type(caught.value).__name__}: {caught.value}")
    start = time.perf_counter()
    lane.close(failed=True)
    return {"errors": errors, "close_s": time.perf_counter() - start, "launched": len(lane.recorder.comm)}


def test_a_failed_launch_fails_every_later_launch_of_the_step_at_once():
    for outcome in run_local_ranks(_failed_launch, 2):
        first, second = outcome.result["errors"]
        assert first == "RuntimeError: the split sizes never came"
        assert second.startswith(CollectiveError.__name__)
        assert "layer1 combine (microbatch 2) not launched: layer1 dispatch (microbatch 2) failed" in second
        assert outcome.result["launched"] == 0, "an all-to-all went out after a failed launch"
        assert outcome.result["close_s"] < 1.0


def test_without_a_peer_group_the_lane_launches_on_the_host():
    groups = single_process_groups()
    lane = lane_for(groups, torch.device("cpu"), launch_off_host=True)
    assert not lane.launches_off_host


def test_the_engine_launches_off_host_on_cpu_where_every_layer_allows_it():
    case = Case(layer_freq=(1, 0))
    groups = EPGroups(2, 0, None, None, None, None, timedelta(seconds=5))
    model = MoEGPTModel(case.config(), groups)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert EPOverlapEngine(model, groups, overlap=True).launches_off_host(cpu)
    assert EPOverlapEngine(model, groups, overlap=True, launch_off_host=True).launches_off_host(cpu)
    assert not EPOverlapEngine(model, groups, overlap=True, launch_off_host=False).launches_off_host(cpu)
    assert not EPOverlapEngine(model, groups, overlap=False).launches_off_host(cpu)
    assert not EPOverlapEngine(model, groups, overlap=True).launches_off_host(cuda)
    model.layers[1].exchange_splits_off_host = False  # a layer whose split exchange must stay on the host thread
    assert not EPOverlapEngine(model, groups, overlap=True).launches_off_host(cpu)


@pytest.mark.parametrize(
    "overlap, layer_allows, message, fix",
    [
        (
            False, True,
            "[launch_off_host_needs_overlap] ep_overlap.launch_off_host=True, "
            "comm_overlap.overlap_moe_expert_parallel_comm=False: launch_off_host launches the overlapped schedule's "
            "all-to-alls, and overlap is off.",
            "Fix: leave launch_off_host None (where it applies) or False, or turn overlap on.",
        ),
        (
            True, False,
            "launch_off_host=True: a layer of this model does not allow its split exchange off the host",
            "leave it None (where it applies) or set it False",
        ),
    ],
)  # fmt: skip
def test_insisting_on_launching_off_the_host_where_it_cannot_apply_is_an_error(overlap, layer_allows, message, fix):
    groups = EPGroups(2, 0, None, None, None, None, timedelta(seconds=5))
    model = MoEGPTModel(Case(layer_freq=(1,)).config(), groups)
    model.layers[0].exchange_splits_off_host = layer_allows
    with pytest.raises(ValueError) as caught:
        EPOverlapEngine(model, groups, overlap=overlap, launch_off_host=True)
    assert message in str(caught.value)
    assert str(caught.value).endswith(fix)


class _NvtxRecorder:
    """Stands in for torch.cuda.nvtx: records the ranges a lane pushes, nested as they were."""

    def __init__(self):
        self.pushed, self.depth, self.deepest = [], 0, 0

    def range_push(self, name: str) -> None:
        self.pushed.append(name)
        self.depth += 1
        self.deepest = max(self.deepest, self.depth)

    def range_pop(self) -> None:
        self.depth -= 1


def _cuda_lane_ranges(rank: int, world: int, profiled: bool = True) -> dict:
    from megatron.core.utils import configure_nvtx_profiling

    from megatron.bridge.training.ep_overlap.runtime.lanes import CudaLane
    from megatron.bridge.training.ep_overlap.runtime.records import HostClock, StepRecorder

    from .mcore_cpu import install_cpu_stubs

    install_cpu_stubs()  # the CUDA lane's streams and events, on a host without a GPU
    configure_nvtx_profiling(profiled)  # the user's profiling switch (Megatron-LM: --nvtx-ranges in the window)
    groups = init_ep_groups(world, timedelta(seconds=30))
    nvtx = _NvtxRecorder()
    lane = CudaLane(groups, StepRecorder(clock=HostClock()), nvtx=nvtx)
    with lane.compute("pre_dispatch", 3, 2):
        pass
    x = torch.ones(4, 2)
    lane.all_to_all(x, [2, 2], [2, 2], op="dispatch", layer=3, microbatch=2).wait()
    with lane.compute("combine_bwd", 3, 1):
        pass
    with lane.compute("attention_wgrad", 0, 1), lane.compute("embedding", -1, 1):  # nested ranges close in order
        pass
    lane.run_comm(lambda: x * 2, op="combine", layer=1, microbatch=0).wait()
    return {"pushed": nvtx.pushed, "open": nvtx.depth, "deepest": nvtx.deepest}


def test_the_cuda_lane_puts_every_node_in_a_named_nvtx_range():
    for outcome in run_local_ranks(_cuda_lane_ranges, 2):
        assert outcome.result["pushed"] == [
            "ep_overlap/compute/F.pre_dispatch/L3/mb2",
            "ep_overlap/comm/F.dispatch/L3/mb2",
            "ep_overlap/compute/B.combine/L3/mb1",
            "ep_overlap/compute/B.attention_wgrad/L0/mb1",
            "ep_overlap/compute/F.embedding/mb1",
            "ep_overlap/comm/F.combine/L1/mb0",
        ]
        assert outcome.result["open"] == 0 and outcome.result["deepest"] == 2


def test_the_cuda_lane_opens_no_range_unless_the_user_profiles():
    for outcome in run_local_ranks(_cuda_lane_ranges, 2, (False,)):
        assert outcome.result == {"pushed": [], "open": 0, "deepest": 0}


def test_the_cpu_lane_opens_no_range():
    from megatron.bridge.training.ep_overlap.runtime.lanes import CpuLane, range_name

    assert CpuLane.nvtx is None
    assert range_name("p2p", "recv_gradient", -1, 4, role="B") == "ep_overlap/p2p/B.recv_gradient/mb4"


def test_each_lane_says_how_it_issues_the_program_and_the_nodes_follow_it():
    """The CPU lane's compute blocks the host: program order. The CUDA lane only queues work: its host syncs go after
    what can be queued without them (``program.interpreter.issue_order``). The nodes run the ops as their lane says."""
    from megatron.bridge.training.ep_overlap.program.interpreter import IssueOrder
    from megatron.bridge.training.ep_overlap.runtime.lanes import CpuLane, CudaLane
    from megatron.bridge.training.ep_overlap.runtime.nodes import MicrobatchNodes

    assert CpuLane.issue == IssueOrder.HOST and CudaLane.issue == IssueOrder.DEVICE
    lane = lane_for(single_process_groups(), torch.device("cpu"), launch_off_host=True)
    nodes = MicrobatchNodes.__new__(MicrobatchNodes)
    nodes.lane = lane
    assert nodes.issue == IssueOrder.HOST
    lane.issue = IssueOrder.DEVICE  # the device-lane stand-in of test_launch_order.py, on one lane
    assert nodes.issue == IssueOrder.DEVICE
