"""The CUDA path on CPU ranks under emulated streams (``cuda_emulation.py``), race-checked by PyTorch's sanitizer:
the real ``CudaLane``, a planted missing wait and a planted early free (both reported), Megatron-Core's own plan as
the control, and our plan clean and bitwise equal to the plain path, creating no more events than Megatron-Core's."""

import functools
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
        assert any(e.startswith("unsynchronized: all_to_all_single") for e in outcome.result), outcome
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


@functools.cache
def _arms(arms: tuple[str, ...], case: McoreCase, setup: str | None = None, pipeline: bool = False) -> dict:
    world = 4 if pipeline else 2
    return {arm: [o.result for o in run_local_ranks(emulated_arm, world, (arm, case, pipeline, None, setup))]
            for arm in arms}  # fmt: skip


def _bitwise(plain: dict, hook: dict) -> bool:
    grads = plain["grads"].keys() == hook["grads"].keys()
    return hook["losses"] == plain["losses"] and grads and all(torch.equal(hook["grads"][n], g) for n, g in
                                                                plain["grads"].items())  # fmt: skip


CASE = McoreCase(delay_wgrad=True, microbatches=3, steps=2)


def test_megatron_cores_own_plan_runs_clean_under_the_emulation():
    for mcore in _arms(("mcore",), CASE)["mcore"]:
        assert mcore["errors"] == [], mcore["errors"][:3]


def test_our_plan_runs_clean_bitwise_and_creates_no_more_than_megatron_cores():
    runs = _arms(("plain", "hook"), CASE)
    for plain, hook, mcore in zip(runs["plain"], runs["hook"], _arms(("mcore",), CASE)["mcore"]):
        assert hook["errors"] == [] and _bitwise(plain, hook), hook["errors"][:3]
        steady_hook, steady_mcore = hook["steps"][-1]["counts"], mcore["steps"][-1]["counts"]
        for count in ("events", "timing events", "streams", "host waits"):
            assert steady_hook.get(count, 0) <= steady_mcore.get(count, 0), (count, steady_hook, steady_mcore)


# One step each: a graph's second replay, a block's reuse and every pairing already happen in the first.
GRAPHED = McoreCase(microbatches=3, steps=1)  # attention, router and moe_preprocess graphed: static output buffers
STATIC_FLEX = McoreCase(dispatcher="flex", flex_backend="hybridep", topk=1, steps=1, microbatches=3,
                        config=(("num_moe_experts", 2),))  # fmt: skip
PIPELINE = McoreCase(layer_freq=(1, 0, 1, 1), delay_wgrad=True, microbatches=2, steps=1)


def test_graphed_moe_preprocess_runs_clean_and_bitwise_with_static_graph_buffers():
    runs = _arms(("plain", "hook"), GRAPHED, "graphed-preprocess")
    for plain, hook in zip(runs["plain"], runs["hook"]):
        assert hook["errors"] == [] and _bitwise(plain, hook)


def test_graphed_moe_preprocess_no_host_wait_waits_for_b_experts_backward():
    """The split sizes' copy (Megatron-Core's, at ``before_ep_alltoall`` when ``moe_preprocess`` is graphed) must be
    made where it waits for F's routing only, as Megatron-Core makes it from its comm stream."""
    for hook in _arms(("plain", "hook"), GRAPHED, "graphed-preprocess")["hook"]:
        late = [w for step in hook["steps"] for w in step["host_waits"] if "experts_bwd" in w[3]]
        assert late == []


def test_pp2_vpp2_runs_clean_and_bitwise():
    runs = _arms(("plain", "hook"), PIPELINE, pipeline=True)
    for plain, hook in zip(runs["plain"], runs["hook"]):
        assert hook["errors"] == [] and _bitwise(plain, hook)


def test_the_static_shape_flex_stand_in_runs_bitwise():
    runs = _arms(("plain", "hook"), STATIC_FLEX, "static-flex")
    for plain, hook in zip(runs["plain"], runs["hook"]):
        assert _bitwise(plain, hook)


def test_the_static_shape_flex_stand_in_runs_clean():
    for hook in _arms(("plain", "hook"), STATIC_FLEX, "static-flex")["hook"]:
        assert hook["errors"] == []
