"""The CUDA path on CPU ranks under emulated streams (``cuda_emulation.py``), race-checked by PyTorch's sanitizer:
the real ``CudaLane``, a planted missing wait and a planted early free (both reported), Megatron-Core's own plan as
the control, and our plan clean and bitwise equal to the plain path, creating no more events than Megatron-Core's:
alltoall with delayed wgrad, graphed ``moe_preprocess`` (static buffers), PP 2 x VPP 2, the static-shape flex
stand-in, MTP with full recompute in fp8 contexts, ``moe`` recompute's replay, and (``-m wide``) Qwen3-VL and
Qwen3.5-VL in the stock-Bridge interpreter. The arms of one case train in turn on the same forked ranks."""

import functools
import json
from datetime import timedelta

# Imported here once, not again in every forked rank (``make test`` has them from its collection).
import megatron.core.models.gpt  # noqa: F401
import pytest
import torch

import megatron.bridge.training.ep_overlap.mcore  # noqa: F401

from .emulated_arms import emulated_arms
from .local_ranks import init_ep_groups, run_local_ranks
from .mcore_models import McoreCase
from .test_vision_language import WORKERS, plugin, python  # noqa: F401 (the stock-Bridge fixtures)


def _lane_cases(rank: int, world: int) -> dict:
    """One rank's emulated device, a fresh ``CudaLane`` per case: the clean dispatch and free, the PP x VPP launch,
    then the planted missing wait and the planted early free (each undone after); per case what the emulation
    reported while it ran."""
    from megatron.bridge.training.ep_overlap.runtime.lanes import CudaLane
    from megatron.bridge.training.ep_overlap.runtime.records import HostClock, StepRecorder

    from . import cuda_emulation
    from .mcore_cpu import install_cpu_stubs

    install_cpu_stubs()
    emu = cuda_emulation.install()
    groups = init_ep_groups(world, timedelta(seconds=30))
    out = {}
    for case in ("clean", "launch", "missing wait", "early free"):
        comm_waits_for, record_stream = CudaLane._comm_waits_for, torch.Tensor.record_stream
        if case == "missing wait":
            CudaLane._comm_waits_for = lambda self, layer, microbatch: torch.cuda.current_stream()
        if case == "early free":
            torch.Tensor.record_stream = lambda self, stream: None
        found, lane = len(emu.errors), CudaLane(groups, StepRecorder(clock=HostClock()), torch.cuda.Stream())
        waits_for_b = _launch_waits_for(emu, lane) if case == "launch" else _dispatch_then_free(lane, rank)
        CudaLane._comm_waits_for, torch.Tensor.record_stream = comm_waits_for, record_stream
        out[case] = {"errors": emu.errors[found:], "waits_for_b": waits_for_b}
    return out


def _dispatch_then_free(lane, rank: int) -> None:
    with lane.compute("pre_dispatch", 0, 0):
        sent = torch.ones(4, 8) * (rank + 1)
    pending = lane.all_to_all(sent, [2, 2], [2, 2], op="dispatch", layer=0, microbatch=0)
    sent.untyped_storage().resize_(0)  # freed while the all-to-all may still read it: safe only by record_stream
    with lane.compute("experts", 0, 0):
        out = pending.wait() * 2
    assert out.shape == (4, 8)


def _launch_waits_for(emu, lane) -> bool:
    """PP x VPP: F is microbatch 0 of a chunk whose layer is 2, B microbatch 0 of a chunk whose layer is 0."""
    with lane.compute("pre_dispatch", 2, 0):
        sent = torch.ones(4, 8)
    with lane.compute("experts_bwd", 0, 0):
        torch.ones(4, 8) * 3
    b_experts_bwd = emu.handler.seq_num
    lane.all_to_all(sent, [2, 2], [2, 2], op="dispatch", layer=2, microbatch=0).wait()
    return emu.handler.syncs.is_ordered_after(lane.comm_stream.id, b_experts_bwd, 0)


@pytest.fixture(scope="module")
def lane_cases() -> list[dict]:
    return [outcome.result for outcome in run_local_ranks(_lane_cases, 2)]


def test_the_cuda_lane_runs_clean_and_a_planted_missing_wait_or_early_free_is_reported(lane_cases):
    for rank in lane_cases:
        assert rank["clean"]["errors"] == []
        assert any(e.startswith("unsynchronized: all_to_all_single") for e in rank["missing wait"]["errors"]), rank
        assert any(e.startswith("early free") for e in rank["early free"]["errors"]), rank


def test_a_launch_waits_for_its_own_chunks_compute_not_another_stages_same_microbatch(lane_cases):
    for rank in lane_cases:
        assert rank["launch"] == {"errors": [], "waits_for_b": False}


@functools.cache
def _arms(arms: tuple[str, ...], case: McoreCase, setup: str | None = None, pipeline: bool = False) -> dict:
    """Each arm's result per rank; the arms of one case train in turn on the same ranks."""
    ranks = [
        o.result for o in run_local_ranks(emulated_arms, 4 if pipeline else 2, (arms, case, pipeline, None, setup))
    ]
    return {arm: [rank[arm] for rank in ranks] for arm in arms}


def _bitwise(plain: dict, hook: dict) -> bool:
    grads = plain["grads"].keys() == hook["grads"].keys()
    return hook["losses"] == plain["losses"] and grads and all(torch.equal(hook["grads"][n], g) for n, g in
                                                                plain["grads"].items())  # fmt: skip


CASE = McoreCase(delay_wgrad=True, microbatches=3, steps=2)
CASE_ARMS = ("plain", "mcore", "hook")


def test_megatron_cores_own_plan_runs_clean_under_the_emulation():
    for mcore in _arms(CASE_ARMS, CASE)["mcore"]:
        assert mcore["errors"] == [], mcore["errors"][:3]


def test_our_plan_runs_clean_bitwise_and_creates_no_more_than_megatron_cores():
    runs = _arms(CASE_ARMS, CASE)
    for plain, hook, mcore in zip(runs["plain"], runs["hook"], runs["mcore"]):
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


# MTP, full recompute (the plan's replay) and fp8 contexts in one model; one step.
MTP_RECOMPUTE_FP8 = McoreCase(mtp=True, full_recompute=("uniform", 1), delay_wgrad=True, microbatches=3, steps=1)


def test_mtp_with_full_recompute_in_fp8_contexts_runs_clean_and_bitwise():
    runs = _arms(("plain", "hook"), MTP_RECOMPUTE_FP8, "fp8")
    for plain, hook in zip(runs["plain"], runs["hook"]):
        assert hook["errors"] == [] and _bitwise(plain, hook), hook["errors"][:3]


# 'moe' and 'layernorm' recomputed: each MoE part replayed from the attention's output, its norm dropped again.
MOE_RECOMPUTE = McoreCase(recompute=("moe", "layernorm"), shared_ffn=16, delay_wgrad=True, microbatches=3, steps=1)


def test_moe_recompute_replays_run_clean_and_bitwise():
    runs = _arms(("plain", "hook"), MOE_RECOMPUTE)
    for plain, hook in zip(runs["plain"], runs["hook"]):
        assert hook["errors"] == [] and _bitwise(plain, hook), hook["errors"][:3]
        # the replay reads its routing's counts again, as the plain path's checkpoint does
        copies = [arm["steps"][0]["counts"]["device-to-host copies"] for arm in (plain, hook)]
        assert copies[0] == copies[1], copies


# Latent MoE with delayed wgrad: the output projection's deferred wgrad runs where the plan ran the projection.
LATENT = McoreCase(delay_wgrad=True, microbatches=3, steps=1, config=(("moe_latent_size", 16),))


def test_latent_moe_with_delayed_wgrad_runs_clean_and_bitwise():
    runs = _arms(("plain", "hook"), LATENT, "latent")
    for plain, hook in zip(runs["plain"], runs["hook"]):
        assert hook["errors"] == [] and _bitwise(plain, hook), hook["errors"][:3]


def _latent_wgrad_as_megatron_core_runs_it(emu) -> None:
    """``MoELayer.backward_dw`` whole: the latent output projection's weight gradient on the comm stream."""
    from megatron.bridge.training.ep_overlap.mcore.layer import McoreLayer

    def backward_dw(self):
        if self.is_moe:
            self.layer.mlp.backward_dw()

    McoreLayer.expert_backward_dw = backward_dw


@pytest.mark.wide
def test_latent_wgrad_on_megatron_cores_comm_stream_would_race_with_the_optimizer():
    args = (("plain", "hook"), LATENT, False, _latent_wgrad_as_megatron_core_runs_it, "latent")
    for outcome in run_local_ranks(emulated_arms, 2, args):
        errors = [str(e) for e in outcome.result["hook"]["errors"]]
        assert errors and all("expert_wgrad" in e and "unsynchronized" in e for e in errors), errors[:3]


@pytest.mark.wide
def test_pp2_vpp2_with_mtp_full_recompute_and_fp8_contexts_runs_clean_and_bitwise():
    case = McoreCase(layer_freq=(1, 0, 1, 1), mtp=True, full_recompute=("uniform", 1), delay_wgrad=True, steps=1,
                     microbatches=2)  # fmt: skip
    runs = _arms(("plain", "hook"), case, "fp8", pipeline=True)
    for plain, hook in zip(runs["plain"], runs["hook"]):
        assert hook["errors"] == [] and _bitwise(plain, hook), hook["errors"][:3]


@pytest.mark.wide
def test_qwen3_vl_and_qwen35_vl_run_clean_and_bitwise_and_a_planted_missing_wait_is_reported(request, tmp_path):
    """Bridge 0.6.2's Qwen3-VL MoE (vision tower, deepstack features, multimodal rotary positions) and Qwen3.5-VL MoE
    (gated delta net, gated attention, an MTP layer in the head), images and text-only microbatches, in the
    stock-Bridge interpreter (``vl_emulated_worker.py``), one step; the planted missing wait on Qwen3-VL."""
    from tests.functional_tests import stock_bridge

    interpreter, tree = request.getfixturevalue("python"), request.getfixturevalue("plugin")
    for plant, models in (("", "qwen3_vl,qwen35_vl"), ("missing-wait", "qwen3_vl")):
        out = tmp_path / f"out{plant}.json"
        run = stock_bridge.run(interpreter, tree, WORKERS / "vl_emulated_worker.py", str(out), "--plant", plant,
                               "--models", models)  # fmt: skip
        assert run.returncode == 0, run.stderr[-4000:]
        for rank in json.loads(out.read_text()):
            assert len(rank.pop("streams")) > 1  # the plan's all-to-alls ran on the comm stream
            assert rank.keys() == set(models.split(","))
            for model in rank.values():
                plain, hook = model["arms"]["plain"], model["arms"]["hook"]
                assert hook["plan"] == "McoreVisionLanguageChunk" and plain["images"] > 0
                if plant:
                    assert any(e.startswith("unsynchronized: all_to_all_single") for e in model["errors"])
                else:
                    assert model["errors"] == [], model["errors"][:3]
                    assert hook["losses"] == plain["losses"] and hook["grads"] == plain["grads"]
