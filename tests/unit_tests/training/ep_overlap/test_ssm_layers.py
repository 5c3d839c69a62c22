"""Mamba (``M``) and gated delta net (``G``) layers under this project's plan, bitwise equal to Megatron-Core's plain
path, on CPU with the test-only kernel stand-ins (``ssm_kernels.py``).

Models (``mcore_models.py``, local specs): a Nemotron-3-Nano-like ``HybridModel`` (Mamba, attention, MoE with a
shared expert), a ``HybridModel`` with GDN layers, and a Qwen3-Next-like ``GPTModel`` (GDN and gated attention by
``linear_attention_freq``, MoE with a gated shared expert, zero-centered RMSNorm, one MTP layer). They run under:

    engine        ``EPOverlapEngine(chunk_for(model))``: plain, overlapped, edge pairing, chunked (against the plain
                  path fed the same halves), over 2 Adam steps (``test_mcore_equivalence``'s worker and checks); also
                  full recompute (each MoE group replayed, its Mamba and GDN layers with it)
    driver        Megatron-Core's own ``forward_backward_no_pipelining`` with the hook vs its plain path (also bf16)
    interleaved   Megatron-Core's interleaved driver at PP 2 x VPP 2 x EP 2 (a hybrid pattern with both mixers)
    packed        THD microbatches of two documents (through the driver and through the engine), whose boundaries
                  reach every mixer: Mamba's ``seq_idx`` and GDN's ``cu_seqlens`` (the same rows unpacked give other
                  losses; the patterns have no attention, so only the mixers see the boundaries)
    delayed wgrad local linears: bitwise, GDN's ``backward_dw`` run once per layer, microbatch and step; Mamba's mixer,
                  which has no ``backward_dw``, refused by name when its linears would defer weight gradients

Losses and every gradient must be bitwise equal. The kernels are installed in each forked rank before its model is
built (never in the pytest process).
"""

from datetime import timedelta
from functools import partial

import pytest
import torch

from .bitwise import assert_steps_bitwise
from .local_ranks import run_local_ranks
from .mcore_cpu import init_megatron, install_cpu_stubs
from .mcore_models import QWEN3_NEXT_FIELDS, HybridCase, McoreCase, build_model, install_kernels_for
from .test_mcore_equivalence import check_equal, train_mcore
from .test_mcore_hook import masked_token_loss, train_interleaved, train_with_mcore_driver

SHARED = ("moe_shared_expert_intermediate_size", 16)
NANO = HybridCase(pattern="M*EME", config=(SHARED, ("normalization", "RMSNorm")), microbatches=3)
GDN = HybridCase(pattern="G*EGE", microbatches=3)
QWEN3_NEXT = McoreCase(
    layer_freq=(1, 1, 1, 1), gdn_freq=2, rope=True, mtp=True, shared_ffn=16, config=QWEN3_NEXT_FIELDS, microbatches=3
)


def _prepared(worker, rank: int, world: int, case: McoreCase, *args):
    """``worker`` in this rank, after the kernels ``case`` needs are installed."""
    install_kernels_for(case)
    return worker(rank, world, case, *args)


# ---- the engine ---------------------------------------------------------------------------------------------------

ENGINE = {
    "hybrid-M*EME-nano": NANO,
    "hybrid-G*EGE": GDN,
    "gpt-gdn-qwen3-next-mtp": QWEN3_NEXT,
    # local linears delay nothing (one warning); GDN's backward_dw runs in the attention-wgrad slot, bitwise
    "hybrid-M*EGE-delayed-wgrad": HybridCase(pattern="M*EGE", delay_wgrad=True, microbatches=3),
    # full recompute: the schedule replays each MoE group, its Mamba and GDN layers included, before its backward
    "hybrid-M*EGE-full-uniform1": HybridCase(pattern="M*EGE", full_recompute=("uniform", 1), microbatches=3),
}


@pytest.mark.lab
@pytest.mark.parametrize("name", sorted(ENGINE))
def test_the_engine_runs_mamba_and_gdn_bitwise_equal(name):
    case = ENGINE[name]
    check_equal(case, run_local_ranks(partial(_prepared, train_mcore), case.world, (case,)))


# ---- Megatron-Core's driver with the hook ------------------------------------------------------------------------

DRIVER = {
    "hybrid-M*EME-nano": NANO,
    "hybrid-G*EGE": GDN,
    "gpt-gdn-qwen3-next-mtp": QWEN3_NEXT,
    # bf16, as the recipes train (the overlap flag set when the config is built, as Megatron-Core requires)
    "hybrid-M*EGE-bf16": HybridCase(pattern="M*EGE", bf16=True, microbatches=3),
}


@pytest.mark.parametrize("name", sorted(DRIVER))
def test_megatron_cores_driver_runs_mamba_and_gdn_through_the_hook_bitwise_equal(name):
    case = DRIVER[name]
    for outcome in run_local_ranks(partial(_prepared, train_with_mcore_driver), case.world, (case,)):
        plain, overlap = outcome.result["plain"], outcome.result["overlap"]
        assert_steps_bitwise(plain, overlap, case.steps, outcome.rank)
        expected = sorted([("warmup", 0), *(("paired", i) for i in range(1, case.microbatches))])
        assert all(phases == expected for phases in overlap["phases"])
        mixers = [n for n in plain["grads"][-1] if ".mixer." in n or "in_proj" in n]
        assert mixers and all(plain["grads"][-1][n].abs().sum() > 0 for n in mixers)


def test_megatron_cores_interleaved_driver_runs_mamba_and_gdn_chunks_bitwise_equal():
    # PP 2 x VPP 2 x EP 2: each rank's two chunks hold a Mamba or a GDN layer; Megatron-Core's P2P hooks in the plan
    case = HybridCase(pattern="ME|GE|*E|ME", microbatches=4)
    for outcome in run_local_ranks(partial(_prepared, train_interleaved), 4, (case, True)):
        plain, overlap = outcome.result["plain"], outcome.result["overlap"]
        assert_steps_bitwise(plain, overlap, case.steps, outcome.rank)
        assert "paired" in overlap["phases"]


# ---- packed (THD) microbatches -----------------------------------------------------------------------------------

SEQ, DOCUMENTS = 8, (0, 5, 8)


def packed_params():
    """Two documents in one row, as Megatron-Bridge's ``get_packed_seq_params`` builds them for a hybrid model:
    ``total_tokens`` gives Mamba its ``seq_idx``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens = torch.tensor(DOCUMENTS, dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=5,
                           max_seqlen_kv=5, total_tokens=SEQ)  # fmt: skip


def _packed_step(packed: bool, data_iterator, model, return_schedule_plan: bool = False):
    tokens, labels = next(data_iterator)  # one row of concatenated documents
    loss_mask = (labels % 5 != 0).float()
    positions = torch.cat([torch.arange(b - a) for a, b in zip(DOCUMENTS[:-1], DOCUMENTS[1:])])[None]
    kwargs = dict(labels=labels, loss_mask=loss_mask, packed_seq_params=packed_params() if packed else None)
    mask = None if packed else torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]
    loss_func = partial(masked_token_loss, loss_mask)
    if return_schedule_plan:
        return model.build_schedule_plan(tokens, positions, mask, **kwargs), loss_func
    return model(input_ids=tokens, position_ids=positions, attention_mask=mask, **kwargs), loss_func


def _data(rank: int, step: int, count: int) -> list:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return [tuple(torch.randint(0, 64, (2, 1, SEQ), generator=gen)) for _ in range(count)]


def train_packed(rank: int, world: int, case: McoreCase) -> dict:
    """Packed microbatches through Megatron-Core's driver (plain, and overlapped with the hook), through the engine
    (plain and overlapped), and the same rows unpacked (plain)."""
    install_cpu_stubs()
    install_kernels_for(case)
    init_megatron(world)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from ep_overlap_lab.engine import EPOverlapEngine
    from megatron.bridge.training.ep_overlap.mcore import chunk_for, mcore_ep_groups, use_ep_overlap_schedule

    timeout = timedelta(seconds=60)
    groups = mcore_ep_groups(timeout)
    out = {}
    for arm in ("plain", "overlap", "plain_unpacked", "engine_plain", "engine_overlap"):
        model = build_model(case)
        engine = None
        if arm == "overlap":
            model.config.overlap_moe_expert_parallel_comm = True
            use_ep_overlap_schedule([model], timeout=timeout)
        if arm.startswith("engine"):
            engine = EPOverlapEngine(chunk_for(model), groups, overlap=arm == "engine_overlap")
        losses, grads = [], []
        for step in range(2):
            data = _data(rank, step, case.microbatches)
            if engine is not None:
                losses.append(torch.stack(engine.step([(t, lab, packed_params()) for t, lab in data]).losses))
            else:
                store = get_forward_backward_func()(
                    forward_step_func=partial(_packed_step, arm != "plain_unpacked"), data_iterator=iter(data),
                    model=[model], num_microbatches=case.microbatches, seq_length=SEQ, micro_batch_size=1,
                    forward_only=False,
                )  # fmt: skip
                losses.append(torch.stack([logged["lm loss"] for logged in store]))
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            model.zero_grad(set_to_none=True)
        out[arm] = {"losses": losses, "grads": grads}
    return out


PACKED = {
    "hybrid-MEGE": HybridCase(pattern="MEGE", packed=True, microbatches=3),
    "gpt-gdn-qwen3-next": McoreCase(
        layer_freq=(1, 1), gdn_freq=(1, 1), rope=True, packed=True, config=QWEN3_NEXT_FIELDS, microbatches=3
    ),
}


@pytest.mark.lab
@pytest.mark.parametrize("name", sorted(PACKED))
def test_packed_microbatches_reach_mamba_and_gdn_bitwise_equal(name):
    case = PACKED[name]
    for outcome in run_local_ranks(train_packed, 2, (case,), collective_timeout_s=90):
        arms = outcome.result
        for reference, arm in (("plain", "overlap"), ("engine_plain", "engine_overlap")):
            assert_steps_bitwise(arms[reference], arms[arm], 2, outcome.rank)
        # the boundaries change the numbers: only the mixers see them (no attention layer)
        assert not torch.equal(arms["plain"]["losses"][0], arms["plain_unpacked"]["losses"][0])


# ---- delayed wgrad -----------------------------------------------------------------------------------------------


def _gdn_wgrad_calls(rank: int, world: int, case: HybridCase) -> dict:
    """One engine step with delayed wgrad: how often each GDN mixer's ``backward_dw`` ran."""
    install_cpu_stubs()
    install_kernels_for(case)
    init_megatron(world)
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from ep_overlap_lab.engine import EPOverlapEngine
    from megatron.bridge.training.ep_overlap.mcore import chunk_for, mcore_ep_groups

    model = build_model(case)
    calls = {}
    for name, module in model.named_modules():
        if isinstance(module, GatedDeltaNet):
            calls[name] = 0
            run = module.backward_dw
            module.backward_dw = lambda run=run, name=name: (calls.__setitem__(name, calls[name] + 1), run())[1]
    engine = EPOverlapEngine(chunk_for(model, delay_wgrad=True), mcore_ep_groups(timedelta(seconds=60)),
                             overlap=True, delay_wgrad=True)  # fmt: skip
    gen = torch.Generator().manual_seed(rank)
    engine.step([tuple(torch.randint(0, 64, (2, 2, 8), generator=gen)) for _ in range(case.microbatches)])
    return calls


@pytest.mark.lab
def test_delayed_wgrad_runs_each_gdn_mixers_backward_dw_once_per_microbatch():
    case = HybridCase(pattern="M*EGE-G", microbatches=3)  # GDN layers in an MoE group and in the dense tail
    for outcome in run_local_ranks(_gdn_wgrad_calls, 2, (case,)):
        assert outcome.result == {"decoder.layers.3.self_attention": 3, "decoder.layers.6.self_attention": 3}


def _refuse_deferred_mamba(rank: int, world: int) -> str:
    """Delayed wgrad with a Mamba mixer whose projections are Transformer Engine's (as ``hybrid_stack_spec`` builds
    them; here local linears marked as Transformer Engine's, which the plan recognizes by module)."""
    install_cpu_stubs()
    case = HybridCase(pattern="M*EME")
    install_kernels_for(case)
    init_megatron(world)
    from megatron.bridge.training.ep_overlap.mcore import chunk_for

    model = build_model(case)
    for layer in model.decoder.layers:
        if hasattr(layer, "mixer"):
            for linear in (layer.mixer.in_proj, layer.mixer.out_proj):
                linear.__class__ = type(type(linear).__name__, (type(linear),), {"__module__": _TE})
    try:
        chunk_for(model, delay_wgrad=True)
    except ValueError as error:
        return str(error)
    return "accepted"


_TE = "megatron.core.extensions.transformer_engine"


def test_delayed_wgrad_refuses_a_mamba_mixer_that_would_defer_weight_gradients_by_name():
    for outcome in run_local_ranks(_refuse_deferred_mamba, 2):
        assert outcome.result.startswith("delay_wgrad_compute with MambaLayer layers built from Transformer Engine")
        assert "fix: set delay_wgrad_compute=False" in outcome.result


def test_the_test_models_hold_the_mixers_they_name():
    # the comparisons above mean something only if the layers are Megatron-Core's Mamba and GDN mixers
    def kinds(rank, world, case):
        install_cpu_stubs()
        install_kernels_for(case)
        init_megatron(world)
        model = build_model(case)
        return [type(getattr(layer, "mixer", getattr(layer, "self_attention", None))).__name__
                for layer in model.decoder.layers]  # fmt: skip

    (nano,) = run_local_ranks(kinds, 1, (HybridCase(pattern="M*EME", world=1),))
    assert nano.result == ["MambaMixer", "SelfAttention", "IdentityOp", "MambaMixer", "IdentityOp"]
    (qwen,) = run_local_ranks(kinds, 1, (McoreCase(layer_freq=(1, 1, 1, 1), gdn_freq=2, world=1),))
    assert qwen.result == ["GatedDeltaNet", "SelfAttention", "GatedDeltaNet", "SelfAttention"]
