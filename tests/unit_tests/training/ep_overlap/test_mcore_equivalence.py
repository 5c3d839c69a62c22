"""Megatron-Core GPTModel and HybridModel with MoE layers: their plain forward/backward vs this project's schedule.

Runs Megatron-Core's own layers (alltoall dispatcher, local specs) on gloo ranks with a test-only CPU fixture,
and compares losses and every parameter gradient bit for bit over several optimizer steps.
"""

import os
from datetime import timedelta

import pytest
import torch

from .bitwise import assert_bitwise
from .fake_deepep import CALLS as FUSED_CALLS
from .fake_deepep import dispatcher_names, install_fake_deepep
from .local_ranks import run_local_ranks
from .mcore_cpu import init_megatron, install_cpu_stubs
from .mcore_models import HybridCase, McoreCase, build_gpt, build_model, expected_mlps


def train_mcore(rank: int, world: int, case: McoreCase) -> dict:
    if case.device == "cuda":
        torch.cuda.set_device(0)
        torch.use_deterministic_algorithms(True)
    else:
        install_cpu_stubs()
    if case.dispatcher == "flex":
        install_fake_deepep()
    init_megatron(world)
    from megatron.core.tensor_parallel.random import CheckpointFunction
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    recomputed = []  # Megatron-Core's checkpoint backward: the recompute ran
    backward = CheckpointFunction.backward
    CheckpointFunction.backward = staticmethod(lambda ctx, *grads: recomputed.append(1) or backward(ctx, *grads))

    from ep_overlap_lab.engine import EPOverlapEngine
    from megatron.bridge.training.ep_overlap.mcore import chunk_for, mcore_ep_groups

    from .halves import as_units, summed_per_microbatch

    groups = mcore_ep_groups(timedelta(seconds=30))
    out = {}
    # overlap_edges: edge pairing, two forwards of one layer in flight (the dispatcher's state kept apart);
    # overlap_chunks: chunked unpaired phases, compared with plain_units (the plain path fed the same halves)
    for arm in ("plain", "overlap", "overlap_edges", "plain_units", "overlap_chunks"):
        model = build_model(case)
        overlap = not arm.startswith("plain")
        plan = chunk_for(model, delay_wgrad=case.delay_wgrad and overlap)
        engine = EPOverlapEngine(
            plan,
            groups,
            overlap=overlap,
            delay_wgrad=case.delay_wgrad and overlap,
            edge_pairing=arm == "overlap_edges",
            moe_ep_overlap_chunks=2 if arm == "overlap_chunks" else 1,
        )
        mtp_scales = []  # what the step ran with (finish_step puts back what it found)
        (hooks,) = engine.step_hooks  # the engine's hooks on the plan (step_hooks.McoreStepHooks)
        start_step = hooks.start_step
        hooks.start_step = lambda loss, start=start_step, seen=mtp_scales: (
            start(loss),
            seen.append(float(MTPLossAutoScaler.main_loss_backward_scale)),
        )
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses, grads = [], []
        FUSED_CALLS.clear()
        recomputed.clear()
        for step in range(case.steps):
            gen = torch.Generator().manual_seed(100 * step + rank)
            data = [
                tuple(torch.randint(0, 64, (2, 2, 8), generator=gen).to(case.device)) for _ in range(case.microbatches)
            ]
            if arm == "plain_units":
                halves, plan_units = as_units(data)
                result = engine.step(halves)
                losses.append(summed_per_microbatch(plan_units, result.losses))
            else:
                losses.append(torch.stack(engine.step(data).losses))
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        out[arm] = {
            "losses": losses,
            "grads": grads,
            "mlps": [type(getattr(layer, "mlp", None)).__name__ for layer in model.decoder.layers],  # Mamba: none
            "biases": {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")},
            "params": sorted(n for n, _ in model.named_parameters()),
            "mtp_scale": mtp_scales[-1],
            "dispatchers": dispatcher_names(model),
            "attentions": {type(m).__name__ for m in model.modules() if type(m).__name__.endswith("SelfAttention")},
            "recomputed": len(recomputed),
            "fused_calls": dict(FUSED_CALLS),  # each runs once per MoE layer and microbatch, in the comm nodes only
        }
    return out


CASES = {
    "ep2-fp32-top2": McoreCase(),
    "ep2-fp32-top1-mixed": McoreCase(topk=1, layer_freq=(1, 0)),
    "ep2-bf16-top2": McoreCase(bf16=True),
    "ep4-fp32-top2": McoreCase(world=4, microbatches=2),
    "ep2-fp32-top2-rope": McoreCase(rope=True),
    "ep2-fp32-delayed-wgrad-local-linears": McoreCase(delay_wgrad=True),
    # The engine moves the routers' biases after each step as finalize_model_grads would; later steps use them.
    "ep2-fp32-top1-expert-bias": McoreCase(topk=1, expert_bias=True, steps=3),
    # The output layer's and the embedding's gradients of a tied weight summed per microbatch, as autograd sums them.
    "ep2-fp32-tied-embeddings": McoreCase(tied=True, steps=3),
    "ep2-bf16-tied-embeddings": McoreCase(tied=True, bf16=True),
    # One MTP layer (an MoE layer here) in the head, its loss included; its embedding's weights (word and learned
    # positions) get their gradients summed with the embedding's per microbatch, as the tied weight does.
    "ep2-fp32-mtp": McoreCase(mtp=True, steps=3),
    "ep2-fp32-mtp-tied-rope": McoreCase(mtp=True, tied=True, rope=True),
    "ep2-bf16-mtp-top1-mixed": McoreCase(mtp=True, bf16=True, topk=1, layer_freq=(1, 0)),
    # The flex dispatcher (DeepEP's contract, on gloo): the backend's fused dispatch and combine and their backward
    # run as the comm nodes; routing state of two microbatches kept apart in the backend's manager too.
    # Multi-latent attention (DeepSeek-V3's attention: latent q/kv projections, yarn rotary inside the attention).
    "ep2-fp32-top2-mla": McoreCase(mla=True, steps=3),
    # Selective recompute of the core attention: Megatron-Core's attention checkpoints it inside the node the plan
    # calls whole (pre_dispatch), and recomputes it in that node's backward.
    "ep2-fp32-top2-recompute-core-attn": McoreCase(recompute=("core_attn",)),
    "ep2-fp32-top2-mla-recompute-core-attn": McoreCase(mla=True, recompute=("core_attn",)),
    # Shared experts, computed in pre_dispatch; recomputed: in its backward, beside the other microbatch's combine.
    "ep2-fp32-top2-shared-experts": McoreCase(shared_ffn=16),
    "ep2-fp32-top2-recompute-shared-experts": McoreCase(shared_ffn=16, recompute=("shared_experts",)),
    # DeepSeek-V3's recipe in small: MLA, sigmoid router with expert bias, one MTP layer, the flex dispatcher.
    "ep2-fp32-deepseek-like": McoreCase(mla=True, expert_bias=True, mtp=True, dispatcher="flex", steps=3),
    "ep2-fp32-top2-flex": McoreCase(dispatcher="flex", steps=3),
    "ep2-bf16-top1-mixed-flex": McoreCase(dispatcher="flex", bf16=True, topk=1, layer_freq=(1, 0)),
    "ep4-fp32-top2-flex-mtp": McoreCase(dispatcher="flex", world=4, microbatches=2, mtp=True),
    # Full recompute: the plain path is Megatron-Core's own checkpointed forward, the schedule replays each segment
    # (one layer; two), MTP's depth checkpointed by Megatron-Core inside the head on both paths.
    "ep2-fp32-full-uniform1": McoreCase(full_recompute=("uniform", 1)),
    "ep2-bf16-full-uniform1-mtp-expert-bias": McoreCase(
        bf16=True, full_recompute=("uniform", 1), mtp=True, expert_bias=True, topk=1, steps=3
    ),
    "ep2-fp32-full-uniform2-tied": McoreCase(full_recompute=("uniform", 2), tied=True),
    "ep2-fp32-full-block1-flex": McoreCase(full_recompute=("block", 1), dispatcher="flex"),
    # HybridEP's contract: the backend also permutes the rows expert by expert, one probability per row.
    "ep2-fp32-top2-hybridep": McoreCase(dispatcher="flex", flex_backend="hybridep", steps=3),
    "ep2-bf16-top1-mixed-hybridep": McoreCase(
        dispatcher="flex", flex_backend="hybridep", bf16=True, topk=1, layer_freq=(1, 0)
    ),  # fmt: skip
}


def _hybrid_cases() -> dict:
    return {
        # MoE groups: the compute layers after one MoE layer up to and including the next.
        "hybrid-*E*E": HybridCase(pattern="*E*E"),
        "hybrid-*-*E-": HybridCase(pattern="*-*E-"),  # a dense unit after the last MoE layer
        "hybrid-E*E--top1-rope": HybridCase(pattern="E*E--", topk=1, rope=True),  # first layer MoE
        "hybrid-*E*E-delayed-wgrad": HybridCase(pattern="*E*E", delay_wgrad=True),
        "hybrid-*E-E-tied": HybridCase(pattern="*E-E", tied=True),
        "hybrid-*E*E/*E-mtp": HybridCase(pattern="*E*E/*E", steps=3),  # one MTP depth: attention and MoE
        "hybrid-*E-E-flex": HybridCase(pattern="*E-E", dispatcher="flex"),
        "hybrid-+E+E-mla": HybridCase(pattern="+E+E"),  # multi-latent attention layers in the groups
        "hybrid-*E*E/*E-mtp-full-uniform1": HybridCase(pattern="*E*E/*E", full_recompute=("uniform", 1)),
    }


CASES.update(_hybrid_cases())


def check_equal(case: McoreCase, outcomes) -> None:
    for outcome in outcomes:
        plain = outcome.result["plain"]
        assert plain["mlps"] == expected_mlps(case)
        assert set(plain["grads"][0]) == set(plain["params"])  # every parameter trains in the plain path ...
        for reference, arm in (("plain", "overlap"), ("plain", "overlap_edges"), ("plain_units", "overlap_chunks")):
            expected, overlap = outcome.result[reference], outcome.result[arm]
            where = f"rank {outcome.rank} {arm}"
            for step in range(case.steps):
                assert_bitwise(expected["losses"][step], overlap["losses"][step], f"{where} step {step} losses")
                assert expected["grads"][step].keys() == overlap["grads"][step].keys()  # ... and in the schedule
                for param, grad in expected["grads"][step].items():
                    assert_bitwise(grad, overlap["grads"][step][param], f"{where} step {step} {param}")
            for name, bias in expected["biases"].items():
                assert_bitwise(bias, overlap["biases"][name], f"{where} final {name}")
        if case.expert_bias:
            assert len(plain["biases"]) == expected_mlps(case).count("MoELayer") + has_mtp(case)  # its MoE layer
            assert all(bias.abs().sum() > 0 for bias in plain["biases"].values())
        assert any("experts" in n and g.abs().sum() > 0 for n, g in plain["grads"][-1].items())
        # Each recomputed part's checkpoint runs its backward once per microbatch and step: every attention, and
        # the shared experts of every MoE layer.
        layers = len(expected_mlps(case)) + has_mtp(case)
        parts = layers * ("core_attn" in case.recompute)
        parts += expected_mlps(case).count("MoELayer") * ("shared_experts" in case.recompute)
        expected = parts * case.microbatches * case.steps
        if case.full_recompute:  # Megatron-Core checkpoints its blocks' segments in the plain path; the schedule
            # replays them itself, and both run the MTP block's own checkpoints in the head (uniform only; a hybrid
            # depth checkpoints its own layers too)
            method, n = case.full_recompute
            decoder = len(expected_mlps(case))
            blocks = -(-decoder // n) if method == "uniform" else min(n, decoder)
            runs = case.microbatches * case.steps
            mtp = outcome.result["overlap"]["recomputed"]
            assert (mtp > 0) == (has_mtp(case) and method == "uniform") and mtp % runs == 0
            assert plain["recomputed"] - mtp == blocks * runs
        else:
            assert plain["recomputed"] == outcome.result["overlap"]["recomputed"] == expected
        mla = getattr(case, "mla", False) or "+" in getattr(case, "pattern", "")
        assert ("MLASelfAttention" in plain["attentions"]) == mla
        if case.dispatcher == "flex":
            assert plain["dispatchers"] == {"MoEFlexTokenDispatcher"}
            assert set(plain["fused_calls"]) == {"dispatch", "dispatch_bwd", "combine", "combine_bwd"}
            for arm in ("overlap", "overlap_edges"):
                assert outcome.result[arm]["fused_calls"] == plain["fused_calls"], arm
        if has_mtp(case):  # the MTP loss trains the MTP layer, weighted per unit and DP rank as Megatron-Core does
            from ep_overlap_lab.program.units import units

            assert any(n.startswith("mtp.") and g.abs().sum() > 0 for n, g in plain["grads"][-1].items())
            dp = case.world  # EP = world: every rank is data-parallel for the non-expert weights
            assert plain["mtp_scale"] == pytest.approx(1 / (case.microbatches * dp))
            halves = len(units(case.microbatches, 2))
            assert outcome.result["plain_units"]["mtp_scale"] == pytest.approx(1 / (halves * dp))


def has_mtp(case: McoreCase) -> bool:
    return case.mtp or (isinstance(case, HybridCase) and "/" in case.pattern)


@pytest.mark.lab
@pytest.mark.parametrize("name", sorted(CASES))
def test_mcore_overlap_is_bitwise_equal_to_mcore_plain(name):
    case = CASES[name]
    check_equal(case, run_local_ranks(train_mcore, case.world, (case,)))


@pytest.mark.gpu
@pytest.mark.parametrize("dispatcher", ["alltoall", "flex"])
@pytest.mark.parametrize("bf16", [False, True])
def test_mcore_on_one_gpu_with_two_gloo_ranks(bf16, dispatcher):
    # CUDA streams and events for real; gloo stages the all-to-all through host memory. flex: tests' fake_deepep's
    # fused functions and their backward run on the lane's comm stream.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    case = McoreCase(bf16=bf16, device="cuda", dispatcher=dispatcher)
    check_equal(case, run_local_ranks(train_mcore, 2, (case,), start_method="spawn"))


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", ["*E*E-", "E-*E"])
def test_hybrid_on_one_gpu_with_two_gloo_ranks(pattern):
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    case = HybridCase(pattern=pattern, device="cuda")
    check_equal(case, run_local_ranks(train_mcore, 2, (case,), start_method="spawn"))


@pytest.mark.gpu
def test_hybrid_mamba_with_transformer_engine_specs_on_one_gpu():
    # Megatron-Core's own hybrid spec (Transformer Engine layers, Mamba kernels): Mamba layers run inside MoE groups.
    pytest.importorskip("transformer_engine.pytorch")
    pytest.importorskip("mamba_ssm")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    case = HybridCase(pattern="ME*EM", te=True, device="cuda")
    check_equal(case, run_local_ranks(train_mcore, 2, (case,), start_method="spawn"))


def _doc_snippet(rank: int, world: int) -> list[float]:
    """The "From a Megatron-Core training script" snippet of megatron-core-integration.md, run as a user would: with
    a model, an optimizer, the EP size and the steps' data in hand (the model built after parallel_state, which the
    snippet's first line initializes, so that line is done here first and then skipped)."""
    import contextlib
    import re
    from pathlib import Path

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    install_cpu_stubs()
    doc = (Path(__file__).resolve().parents[4] / "docs/training/megatron-core-integration.md").read_text()
    snippet = re.search(r"From a Megatron-Core training script[^\n]*:\n\n```python\n(.*?)```", doc, re.S).group(1)
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    model = build_gpt(McoreCase())
    gen = torch.Generator().manual_seed(rank)
    steps = [[tuple(torch.randint(0, 64, (2, 2, 8), generator=gen)) for _ in range(3)] for _ in range(2)]
    namespace = {"model": model, "ep": world, "steps": steps, "optimizer": torch.optim.Adam(model.parameters())}
    initialize, parallel_state.initialize_model_parallel = parallel_state.initialize_model_parallel, lambda **k: None
    try:
        exec(snippet, namespace)
    finally:
        parallel_state.initialize_model_parallel = initialize
    return [float(loss) for loss in namespace["result"].losses]


@pytest.mark.lab
def test_the_training_script_snippet_runs_as_written():
    for outcome in run_local_ranks(_doc_snippet, 2, ()):
        assert len(outcome.result) == 3 and all(torch.isfinite(torch.tensor(outcome.result)))
