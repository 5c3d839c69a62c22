"""The CUDA path on CPU ranks under emulated streams (``cuda_emulation.py``), race-checked by PyTorch's sanitizer:
the real ``CudaLane``, a planted missing wait and a planted early free (both reported), Megatron-Core's own plan as
the control, and our plan clean and bitwise equal to the plain path, creating no more events than Megatron-Core's."""

from datetime import timedelta

import torch

from .emulated_arms import emulated_arm
from .local_ranks import init_ep_groups, run_local_ranks
from .mcore_models import McoreCase


def _lane(world: int, plant: str | None = None):
    from megatron.bridge.training.ep_overlap.runtime.lanes import CudaLane
    from megatron.bridge.training.ep_overlap.runtime.records import HostClock, StepRecorder

    from . import cuda_emulation
    from .mcore_cpu import install_cpu_stubs

    install_cpu_stubs()
    emu = cuda_emulation.install()
    if plant == "missing wait":
        CudaLane._comm_waits_for = lambda self, layer, microbatch: torch.cuda.current_stream()
    if plant == "early free":
        torch.Tensor.record_stream = lambda self, stream: None
    groups = init_ep_groups(world, timedelta(seconds=30))
    return emu, CudaLane(groups, StepRecorder(clock=HostClock()), torch.cuda.Stream())


def _dispatch_then_free(rank: int, world: int, plant: str | None) -> list[str]:
    emu, lane = _lane(world, plant)
    with lane.compute("pre_dispatch", 0, 0):
        sent = torch.ones(4, 8) * (rank + 1)
    pending = lane.all_to_all(sent, [2, 2], [2, 2], op="dispatch", layer=0, microbatch=0)
    sent.untyped_storage().resize_(0)  # freed while the all-to-all may still read it: safe only by record_stream
    with lane.compute("experts", 0, 0):
        out = pending.wait() * 2
    assert out.shape == (4, 8)
    return emu.errors


def test_the_cuda_lane_runs_clean_and_a_planted_missing_wait_or_early_free_is_reported():
    for outcome in run_local_ranks(_dispatch_then_free, 2, (None,)):
        assert outcome.result == []
    for outcome in run_local_ranks(_dispatch_then_free, 2, ("missing wait",)):
        assert any(e.startswith("unsynchronized: all_to_all_single on stream") for e in outcome.result), outcome
    for outcome in run_local_ranks(_dispatch_then_free, 2, ("early free",)):
        assert any(e.startswith("early free") for e in outcome.result), outcome.result


def _launch_waits_for(rank: int, world: int) -> dict:
    """PP x VPP: F is microbatch 0 of a chunk whose layer is 2, B microbatch 0 of a chunk whose layer is 0."""
    emu, lane = _lane(world)
    with lane.compute("pre_dispatch", 2, 0):
        sent = torch.ones(4, 8)
    with lane.compute("experts_bwd", 0, 0):
        torch.ones(4, 8) * 3
    b_experts_bwd = emu.handler.seq_num
    lane.all_to_all(sent, [2, 2], [2, 2], op="dispatch", layer=2, microbatch=0).wait()
    syncs = emu.handler.syncs
    return {"waits_for_b": syncs.is_ordered_after(lane.comm_stream.id, b_experts_bwd, 0), "errors": emu.errors}


def test_a_launch_waits_for_its_own_chunks_compute_not_another_stages_same_microbatch():
    for outcome in run_local_ranks(_launch_waits_for, 2):
        assert outcome.result == {"waits_for_b": False, "errors": []}


CASE = McoreCase(delay_wgrad=True, microbatches=3, steps=2)


def test_megatron_cores_plan_and_ours_run_clean_under_the_emulation_and_ours_bitwise():
    runs = {arm: run_local_ranks(emulated_arm, 2, (arm, CASE)) for arm in ("plain", "mcore", "hook")}
    for rank in range(2):
        plain, mcore, hook = (runs[arm][rank].result for arm in ("plain", "mcore", "hook"))
        assert mcore["errors"] == [] and hook["errors"] == [], (mcore["errors"][:3], hook["errors"][:3])
        assert hook["losses"] == plain["losses"]
        assert hook["grads"].keys() == plain["grads"].keys()
        assert all(torch.equal(hook["grads"][n], plain["grads"][n]) for n in plain["grads"])
        steady_hook, steady_mcore = hook["steps"][-1]["counts"], mcore["steps"][-1]["counts"]
        for count in ("events", "timing events", "streams", "host waits"):
            assert steady_hook.get(count, 0) <= steady_mcore.get(count, 0), (count, steady_hook, steady_mcore)
