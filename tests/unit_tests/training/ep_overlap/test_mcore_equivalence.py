"""Megatron-Core GPTModel with MoE layers: its plain forward/backward vs this project's overlapped schedule.

Runs Megatron-Core's own layers (alltoall dispatcher, local specs) on gloo ranks with a test-only CPU fixture,
and compares losses and every parameter gradient bit for bit over several optimizer steps.
"""

import os
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch

from megatron.bridge.utils.multiprocess import run_local_ranks

from .mcore_cpu import init_megatron, install_cpu_stubs
from .test_numerics import assert_bitwise
from .workers import as_units, summed_per_microbatch


@dataclass(frozen=True)
class McoreCase:
    world: int = 2
    bf16: bool = False
    topk: int = 2
    layer_freq: tuple = (1, 1)
    delay_wgrad: bool = False
    microbatches: int = 4
    steps: int = 2
    device: str = "cpu"
    rope: bool = False
    expert_bias: bool = False  # sigmoid scores with aux-loss-free load balancing
    mtp: bool = False  # one multi-token prediction layer


def build_gpt(case: McoreCase, *, overlap_flag: bool = False):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=len(case.layer_freq),
        hidden_size=32,
        num_attention_heads=2,
        ffn_hidden_size=48,
        num_moe_experts=2 * case.world,
        moe_ffn_hidden_size=16,
        moe_router_topk=case.topk,
        moe_router_pre_softmax=case.topk == 1,
        moe_router_load_balancing_type="none",
        moe_layer_freq=list(case.layer_freq),
        expert_model_parallel_size=case.world,
        moe_token_dispatcher_type="alltoall",
        use_cpu_initialization=True,
        add_bias_linear=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bf16=case.bf16,
        params_dtype=torch.bfloat16 if case.bf16 else torch.float32,
        delay_wgrad_compute=False,
        overlap_moe_expert_parallel_comm=overlap_flag,  # Megatron-Core accepts it with bf16 only
        moe_router_score_function="sigmoid" if case.expert_bias else "softmax",
        moe_router_enable_expert_bias=case.expert_bias,
        moe_router_bias_update_rate=0.05,
        mtp_num_layers=1 if case.mtp else None,
    )
    torch.manual_seed(1234)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    mtp = get_gpt_mtp_block_spec(config, spec.layer_specs[-1], use_transformer_engine=False) if case.mtp else None
    model = GPTModel(
        config,
        transformer_layer_spec=spec,
        mtp_block_spec=mtp,
        vocab_size=64,
        max_sequence_length=8,
        position_embedding_type="rope" if case.rope else "learned_absolute",
        share_embeddings_and_output_weights=False,
    )
    model = model.to(case.device)
    return model.bfloat16() if case.bf16 else model  # what Megatron's Float16Module does to the module


def train_mcore(rank: int, world: int, case: McoreCase) -> dict:
    if case.device == "cuda":
        torch.cuda.set_device(0)
        torch.use_deterministic_algorithms(True)
    else:
        install_cpu_stubs()
    init_megatron(world)
    from megatron.bridge.training.ep_overlap import EPOverlapEngine
    from megatron.bridge.training.ep_overlap.mcore import McoreGPTPlan, mcore_ep_groups

    groups = mcore_ep_groups(timedelta(seconds=30))
    out = {}
    # overlap_edges: edge pairing, two forwards of one layer in flight (the dispatcher's state kept apart);
    # overlap_chunks: chunked unpaired phases, compared with plain_units (the plain path fed the same halves)
    for arm in ("plain", "overlap", "overlap_edges", "plain_units", "overlap_chunks"):
        model = build_gpt(case)
        overlap = not arm.startswith("plain")
        plan = McoreGPTPlan(model, delay_wgrad=case.delay_wgrad and overlap)
        engine = EPOverlapEngine(
            plan,
            groups,
            overlap=overlap,
            delay_wgrad=case.delay_wgrad and overlap,
            edge_pairing=arm == "overlap_edges",
            moe_ep_overlap_chunks=2 if arm == "overlap_chunks" else 1,
        )
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses, grads = [], []
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
            "mlps": [type(layer.mlp).__name__ for layer in model.decoder.layers],
            "biases": {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")},
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
}


def check_equal(case: McoreCase, outcomes) -> None:
    for outcome in outcomes:
        plain = outcome.result["plain"]
        assert plain["mlps"] == ["MoELayer" if moe else "MLP" for moe in case.layer_freq]
        for reference, arm in (("plain", "overlap"), ("plain", "overlap_edges"), ("plain_units", "overlap_chunks")):
            expected, overlap = outcome.result[reference], outcome.result[arm]
            where = f"rank {outcome.rank} {arm}"
            for step in range(case.steps):
                assert_bitwise(expected["losses"][step], overlap["losses"][step], f"{where} step {step} losses")
                assert expected["grads"][step].keys() == overlap["grads"][step].keys()
                for param, grad in expected["grads"][step].items():
                    assert_bitwise(grad, overlap["grads"][step][param], f"{where} step {step} {param}")
            for name, bias in expected["biases"].items():
                assert_bitwise(bias, overlap["biases"][name], f"{where} final {name}")
        if case.expert_bias:
            assert len(plain["biases"]) == sum(case.layer_freq)
            assert all(bias.abs().sum() > 0 for bias in plain["biases"].values())
        assert any("experts" in n and g.abs().sum() > 0 for n, g in plain["grads"][-1].items())


@pytest.mark.parametrize("name", sorted(CASES))
def test_mcore_overlap_is_bitwise_equal_to_mcore_plain(name):
    case = CASES[name]
    check_equal(case, run_local_ranks(train_mcore, case.world, (case,)))


@pytest.mark.gpu
@pytest.mark.parametrize("bf16", [False, True])
def test_mcore_on_one_gpu_with_two_gloo_ranks(bf16):
    # CUDA streams and events for real; gloo stages the all-to-all through host memory.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    case = McoreCase(bf16=bf16, device="cuda")
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
    snippet = re.search(r"From a Megatron-Core training script:\n\n```python\n(.*?)```", doc, re.S).group(1)
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


def test_the_training_script_snippet_runs_as_written():
    for outcome in run_local_ranks(_doc_snippet, 2, ()):
        assert len(outcome.result) == 3 and all(torch.isfinite(torch.tensor(outcome.result)))
