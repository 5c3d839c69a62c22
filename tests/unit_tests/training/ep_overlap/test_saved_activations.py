"""The activation figure: bytes held for backward, counted exactly (engine/saved.py), and what the schedules hold."""

from datetime import timedelta

import pytest
import torch

from ep_overlap_lab.engine import EPOverlapEngine
from ep_overlap_lab.engine.saved import SavedActivations
from ep_overlap_lab.moe_gpt.grouped_linear import GroupedLinear
from ep_overlap_lab.moe_gpt.model import MoEGPTModel
from ep_overlap_lab.wgrad_store import DiscardedStorage
from megatron.bridge.training.ep_overlap import EPOverlapOptions

from .local_ranks import init_ep_groups, run_local_ranks
from .workers import Case

FP32 = 4


def test_what_autograd_saves_is_counted_once_per_storage_and_released_by_backward():
    w_KN = torch.nn.Parameter(torch.randn(8, 16))
    x_MK = torch.randn(4, 8, requires_grad=True)
    with SavedActivations([w_KN]) as saved:
        a_MN = x_MK @ w_KN  # saves x and w; w is a parameter, not an activation
        b_MN = torch.relu(a_MN)  # saves its result
        c_MN = b_MN * b_MN  # saves b twice: one storage, counted once
        held = saved.current_bytes
        c_MN.sum().backward()
        assert saved.current_bytes == 0
    assert held == saved.peak_bytes == (4 * 8 + 4 * 16) * FP32


def test_a_delayed_weight_gradient_holds_its_inputs_until_it_runs():
    linear = GroupedLinear(2, 8, 16)
    torch.nn.init.normal_(linear.weight)
    linear.delay_wgrad = True
    x_MK = torch.randn(6, 8, requires_grad=True)
    with SavedActivations(linear.parameters()) as saved:
        linear(x_MK, (2, 4)).sum().backward()  # dgrad now; wgrad queued with x and the output gradient
        assert saved.current_bytes == (6 * 8 + 6 * 16) * FP32
        linear.backward_dw()
        assert saved.current_bytes == 0
    assert linear.weight.grad is not None


@pytest.mark.parametrize("rebuilt", [True, False])
def test_a_freed_saved_storage_does_not_count_until_it_is_rebuilt(rebuilt):
    # What OutputRecompute does with a norm's or an activation's output that the next linear saved.
    w_KN = torch.nn.Parameter(torch.randn(8, 16))
    x_MK = torch.randn(4, 8, requires_grad=True)
    with SavedActivations([w_KN]) as saved:
        a_MK = x_MK * 2  # saves nothing (a scalar factor)
        y_MN = a_MK @ w_KN  # saves a
        storage = a_MK.untyped_storage()
        token = DiscardedStorage.discard(a_MK)
        storage.resize_(0)
        freed = saved.current_bytes
        # A new allocation (the rows received next, say) may reuse the address: it is a storage of its own.
        b_MN = torch.relu(torch.randn(4, 16, requires_grad=True))
        assert saved.current_bytes == 4 * 16 * FP32
        if rebuilt:
            storage.resize_(4 * 8 * FP32)
            storage.copy_((x_MK * 2).detach().untyped_storage())
            DiscardedStorage.restore(token)
            assert saved.current_bytes == (4 * 8 + 4 * 16) * FP32
            y_MN.sum().backward()
        del y_MN  # freed unbuilt (a failed step): its bytes are not taken off twice
        b_MN.sum().backward()
        assert saved.current_bytes == 0
    assert freed == 0
    assert saved.peak_bytes == ((4 * 8 + 4 * 16) * FP32 if rebuilt else 4 * 16 * FP32)


CASE = Case(layer_freq=(0, 0))  # dense layers: every microbatch holds the same bytes


def _peaks(rank: int, world: int, microbatches: int) -> dict:
    groups = init_ep_groups(world, timedelta(seconds=30))
    out = {}
    for arm, overlap in (("plain", False), ("overlap", True)):
        model = MoEGPTModel(CASE.config(), groups)
        engine = EPOverlapEngine(model, groups, overlap=overlap)
        gen = torch.Generator().manual_seed(rank)
        V, S = CASE.config().vocab_size, CASE.config().seq_length
        data = [tuple(torch.randint(0, V, (2, 2, S), generator=gen)) for _ in range(microbatches)]
        out[arm] = [engine.step(data).activation_peak_bytes for _ in range(2)]
    return out


def test_plain_1f1b_holds_one_microbatch_and_a_paired_step_holds_two_at_most():
    one = run_local_ranks(_peaks, 2, (1,))[0].result
    four = run_local_ranks(_peaks, 2, (4,))[0].result
    per_microbatch = one["plain"][0]
    assert per_microbatch > 0
    # Deterministic: the same every step; the plain path frees each microbatch before the next starts.
    assert one["plain"] == four["plain"] == [per_microbatch] * 2
    assert four["overlap"][0] == four["overlap"][1]
    # A paired step holds the forward microbatch while the backward one is still alive, never a third.
    assert per_microbatch < four["overlap"][0] <= 2 * per_microbatch


# Every schedule option the engine runs at PP = 1 (EPOverlapEngine's keywords; None: the plain path).
OPTIONS = {
    "plain": None,
    "overlap": {},
    "delayed-window1": {"delay_wgrad": True, "attention_wgrad_window": 1},
    "delayed-window2": {"delay_wgrad": True, "attention_wgrad_window": 2},
    "edge-pairing": {"edge_pairing": True},
    "chunks": {"moe_ep_overlap_chunks": 2},
    "delayed-chunks": {"delay_wgrad": True, "moe_ep_overlap_chunks": 2},
    "delayed-edges": {"delay_wgrad": True, "edge_pairing": True},
}


def _measured_and_planned(rank: int, world: int, config, microbatches: int, options_by_name=None) -> dict:
    from ep_overlap_lab.planner.memory import ActivationShape, activation_peak
    from megatron.bridge.training.ep_overlap.program.steps import ChunkShape

    groups = init_ep_groups(world, timedelta(seconds=30))
    shape = ActivationShape.of_reference_model(config, micro_batch_size=2)
    out = {}
    losses = config.moe_aux_loss_coeff or config.moe_z_loss_coeff is not None
    for name, options in (options_by_name or OPTIONS).items():
        if losses and "chunks" in name:  # refused: a router loss over half a microbatch is another loss
            continue
        model = MoEGPTModel(config, groups)
        engine = EPOverlapEngine(model, groups, overlap=options is not None, **(options or {}))
        gen = torch.Generator().manual_seed(rank)
        # Token ids and labels in storages of their own (as a data loader gives them; views of one tensor would be
        # counted once).
        shape_BS = (2, config.seq_length)
        data = [
            (torch.randint(0, 64, shape_BS, generator=gen), torch.randint(0, 64, shape_BS, generator=gen))
            for _ in range(microbatches)
        ]
        measured = engine.step(data).activation_peak_bytes
        steps = engine.schedule(microbatches)
        planned = activation_peak(shape, steps, ChunkShape.of(model))
        out[name] = (measured, planned)
    return out


def _config(**fields):
    from ep_overlap_lab.moe_gpt.config import MoEGPTConfig

    base = dict(
        num_layers=3, hidden_size=32, num_attention_heads=2, ffn_hidden_size=48, num_moe_experts=4,
        moe_ffn_hidden_size=16, moe_layer_freq=[1, 0, 1], moe_router_topk=4, expert_model_parallel_size=2,
        seq_length=8, vocab_size=64, add_bias_linear=False,
    )  # fmt: skip
    return MoEGPTConfig(**{**base, **fields})


# Top-k = all experts: every rank receives exactly top-k rows per token, so routing decides no byte.
SHAPES = {
    "fp32-gelu-softmax": _config(),
    "bf16-swiglu-sigmoid-bias": _config(
        bf16=True, gated_linear_unit=True, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True
    ),
    "fp32-swiglu-softmax-first": _config(gated_linear_unit=True, moe_router_pre_softmax=True),
    "bf16-gelu-softmax-dense-first": _config(bf16=True, moe_layer_freq=[0, 1, 1]),
    "fp32-gqa-narrow-heads": _config(num_attention_heads=4, num_query_groups=2, kv_channels=4),
    "fp32-rmsnorm": _config(normalization="RMSNorm"),
    "bf16-rmsnorm-swiglu": _config(normalization="RMSNorm", bf16=True, gated_linear_unit=True),
    "fp32-shared-experts": _config(moe_shared_expert_intermediate_size=24),
    "bf16-swiglu-shared-experts": _config(moe_shared_expert_intermediate_size=24, bf16=True, gated_linear_unit=True),
    "fp32-aux-z-loss": _config(
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01
    ),
    "bf16-seq-aux-sigmoid": _config(
        bf16=True,
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=0.1,
        moe_router_score_function="sigmoid",
    ),  # fmt: skip
    "bf16-z-loss": _config(bf16=True, moe_z_loss_coeff=0.01),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_planner_predicts_the_measured_activation_peak_of_every_schedule_option_exactly(name):
    # The planner's accounting (planner/memory.py: each node's saved tensors from the shape, walked through the
    # schedule program) against the engine's count (engine/saved.py), byte for byte, on each rank.
    for outcome in run_local_ranks(_measured_and_planned, 2, (SHAPES[name], 4)):
        for option, (measured, planned) in outcome.result.items():
            assert planned == measured, f"rank {outcome.rank} {option}: planned {planned}, measured {measured}"
        peaks = {option: measured for option, (measured, _) in outcome.result.items()}
        # What the options cost: a paired step holds more than one microbatch, delayed wgrad keeps gradients until
        # their wgrad runs (longer in window 2), edge pairing holds a third microbatch's forward.
        assert peaks["plain"] <= peaks["overlap"] <= peaks["delayed-window1"] <= peaks["delayed-window2"]
        assert peaks["edge-pairing"] > 1.5 * peaks["overlap"]


def _recomputing(config, modules: tuple[str, ...]):
    from dataclasses import replace

    return replace(config, recompute_granularity="selective", recompute_modules=list(modules), moe_grouped_gemm=True)


RECOMPUTE_CASES = {  # (shape, recompute_modules)
    "swiglu-layernorm-moe-act": (SHAPES["fp32-swiglu-softmax-first"], ("layernorm", "moe_act")),
    "swiglu-moe": (SHAPES["fp32-swiglu-softmax-first"], ("moe",)),
    "shared-experts-layernorm-mlp": (SHAPES["bf16-swiglu-shared-experts"], ("layernorm", "mlp")),
    "rmsnorm-layernorm-core-attn": (SHAPES["bf16-rmsnorm-swiglu"], ("layernorm", "core_attn")),
    "gelu-dense-first-all-five": (
        SHAPES["bf16-gelu-softmax-dense-first"],
        ("layernorm", "core_attn", "moe_act", "mlp", "moe"),
    ),
}


@pytest.mark.parametrize("name", sorted(RECOMPUTE_CASES))
def test_with_recompute_the_planner_gives_an_upper_bound_within_one_nodes_rebuild(name):
    # Between nodes a recomputed part holds what the planner counts; inside a node's backward autograd rebuilds the
    # parts one at a time after letting some tensors go, and inside a forward an output is held until the linear
    # after it ran. The planner counts those on top of all the node holds: never under, over by at most that.
    from ep_overlap_lab.planner.memory import ActivationShape

    shape, modules = RECOMPUTE_CASES[name]
    config = _recomputing(shape, modules)
    held = ActivationShape.of_reference_model(config, micro_batch_size=2)
    layers = range(config.num_layers)
    slack = max(sum(b for _, b in held.rebuilt(node, j, 2)) for node in ("pre_dispatch", "experts") for j in layers)
    slack += max(
        (b for node in ("pre_dispatch", "experts") for j in layers for _, b in held.freed_outputs(node, j, 2)),
        default=0,
    )
    for outcome in run_local_ranks(_measured_and_planned, 2, (config, 4)):
        for option, (measured, planned) in outcome.result.items():
            assert measured <= planned <= measured + slack, f"rank {outcome.rank} {option}: {planned} vs {measured}"


def _frees(rank: int, world: int, recompute_moe: bool) -> dict:
    from megatron.bridge.training.ep_overlap.runtime import nodes

    freed = []
    free = nodes._free
    nodes._free = lambda t: (freed.append(tuple(t.shape)), free(t))  # this forked rank only
    extra = {"recompute_granularity": "selective", "recompute_modules": ["moe"]} if recompute_moe else {}
    case = Case(layer_freq=(1, 0, 1), topk=4, extra=extra)  # every token to every expert: R = P = 4 x 16 rows
    groups = init_ep_groups(world, timedelta(seconds=30))
    engine = EPOverlapEngine(MoEGPTModel(case.config(), groups), groups, overlap=True)
    engine.step([(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))) for _ in range(3)])
    return {shape: freed.count(shape) for shape in set(freed)}


def test_the_all_to_alls_outputs_are_freed_once_used_unless_backward_reads_them():
    # Each MoE layer of each microbatch frees what it sent (dispatch, combine) and, once consumed, what it received:
    # 4 buffers of 64 rows x 32; with the experts recomputed, the received rows are their saved input and stay.
    layers_x_microbatches = 2 * 3
    assert run_local_ranks(_frees, 2, (False,))[0].result == {(64, 32): 4 * layers_x_microbatches}
    assert run_local_ranks(_frees, 2, (True,))[0].result == {(64, 32): 3 * layers_x_microbatches}


def _pipeline_measured_and_planned(rank: int, world: int, config, microbatches: int, virtual: int) -> dict:
    from ep_overlap_lab.moe_gpt import build_pipeline_chunks
    from ep_overlap_lab.planner.memory import ActivationShape, pipeline_peaks

    groups = init_ep_groups(2, timedelta(seconds=30), pipeline_size=2)
    shape = ActivationShape.of_reference_model(config, micro_batch_size=2)
    gen = torch.Generator().manual_seed(rank % 2)
    shape_BS = (2, config.seq_length)
    data = [
        (torch.randint(0, 64, shape_BS, generator=gen), torch.randint(0, 64, shape_BS, generator=gen))
        for _ in range(microbatches)
    ]
    out = {}
    for name, options in (("plain", None), ("overlap", {}), ("delayed", {"delay_wgrad": True})):
        chunks = build_pipeline_chunks(config, groups, 7, groups.pp_rank)
        engine = EPOverlapEngine(chunks, groups, overlap=options is not None, **(options or {}))
        measured = engine.step(data).activation_peak_bytes
        chosen = EPOverlapOptions(overlap=options is not None, **(options or {}))
        planned = pipeline_peaks(shape, chosen, microbatches, 2, virtual)[groups.pp_rank]
        out[name] = (measured, planned)
    return out


@pytest.mark.parametrize("virtual", [1, 2], ids=["pp2-1f1b", "pp2-vpp2"])
def test_the_planner_counts_each_pipeline_ranks_activations_exactly(virtual):
    config = _config(
        num_layers=4, moe_layer_freq=[1, 0, 1, 1], pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=virtual if virtual > 1 else None, pipeline_dtype=torch.float32,
    )  # fmt: skip
    for outcome in run_local_ranks(_pipeline_measured_and_planned, 4, (config, 5, virtual)):
        for name, (measured, planned) in outcome.result.items():
            assert measured == planned, (outcome.rank, name, measured, planned)
