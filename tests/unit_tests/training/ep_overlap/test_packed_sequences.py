"""Packed (THD) microbatches through this project's plan: every document attends only to itself, as in the plain path.

Megatron-Core's own driver (``forward_backward_no_pipelining``) runs a recipe-style forward step that hands both paths
the same ``PackedSeqParams`` (what Megatron-Bridge's ``get_packed_seq_params`` builds, and what the patched
``gpt_step`` passes to ``build_schedule_plan``). The core attention is the test-only THD stand-in
(``thd_attention.py``); each row packs documents of 5 and 3 tokens, position ids restarting per document. Losses and
gradients are bitwise equal to the plain path; the same microbatches unpacked give other losses, so a plan that lost
the boundaries would fail here.
"""

from datetime import timedelta
from functools import partial

import pytest
import torch

from .bitwise import assert_bitwise
from .local_ranks import run_local_ranks
from .mcore_cpu import init_megatron, install_cpu_stubs
from .mcore_models import HybridCase, McoreCase, build_model
from .test_mcore_hook import masked_token_loss

SEQ, DOCUMENTS = 8, (0, 5, 8)


def packed_params(device="cpu"):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens = torch.tensor(DOCUMENTS, dtype=torch.int32, device=device)
    longest = max(b - a for a, b in zip(DOCUMENTS[:-1], DOCUMENTS[1:]))
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)  # fmt: skip


def packed_forward_step(packed: bool, data_iterator, model, return_schedule_plan: bool = False):
    tokens, labels = next(data_iterator)  # one row: a packed microbatch is one row of concatenated documents
    loss_mask = (labels % 5 != 0).float()
    device = tokens.device
    positions = torch.cat([torch.arange(b - a) for a, b in zip(DOCUMENTS[:-1], DOCUMENTS[1:])])[None].to(device)
    kwargs = dict(labels=labels, loss_mask=loss_mask, packed_seq_params=packed_params(device) if packed else None)
    # Unpacked: one causal mask over the whole row (what a plan that dropped the boundaries would run).
    mask = None if packed else torch.ones(SEQ, SEQ, dtype=torch.bool, device=device).triu(1)[None, None]
    loss_func = partial(masked_token_loss, loss_mask)
    if return_schedule_plan:
        return model.build_schedule_plan(tokens, positions, mask, **kwargs), loss_func
    return model(input_ids=tokens, position_ids=positions, attention_mask=mask, **kwargs), loss_func


def train_packed(rank: int, world: int, case: McoreCase) -> dict:
    if case.device == "cuda":
        torch.cuda.set_device(0)
        torch.use_deterministic_algorithms(True)
    else:
        install_cpu_stubs()
    init_megatron(world)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron.bridge.training.ep_overlap.mcore import use_ep_overlap_schedule

    out = {}
    for arm in ("plain", "overlap", "plain_unpacked"):
        model = build_model(case)
        if arm == "overlap":
            model.config.overlap_moe_expert_parallel_comm = True
            use_ep_overlap_schedule([model], timeout=timedelta(seconds=30))
        losses, grads = [], []
        for step in range(2):
            gen = torch.Generator().manual_seed(100 * step + rank)
            data = [tuple(torch.randint(0, 64, (2, 1, SEQ), generator=gen).to(case.device))
                    for _ in range(case.microbatches)]  # fmt: skip
            store = get_forward_backward_func()(
                forward_step_func=partial(packed_forward_step, arm != "plain_unpacked"),
                data_iterator=iter(data),
                model=[model],
                num_microbatches=case.microbatches,
                seq_length=SEQ,
                micro_batch_size=1,
                forward_only=False,
            )
            losses.append(torch.stack([logged["lm loss"] for logged in store]))
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            model.zero_grad(set_to_none=True)
        out[arm] = {"losses": losses, "grads": grads}
    return out


CASES = {
    "gpt-rope": McoreCase(packed=True, rope=True, microbatches=3),
    "gpt-mtp": McoreCase(packed=True, mtp=True, microbatches=2),
    "hybrid-*E*E-rope": HybridCase(packed=True, pattern="*E*E", rope=True, microbatches=3),
}


def check_packed(name: str, case: McoreCase, **launch) -> None:
    for rank in run_local_ranks(train_packed, 2, (case,), collective_timeout_s=60, **launch):
        plain, overlap, unpacked = (rank.result[arm] for arm in ("plain", "overlap", "plain_unpacked"))
        for step in range(2):
            where = f"{name} rank {rank.rank} step {step}"
            assert_bitwise(plain["losses"][step], overlap["losses"][step], f"{where} losses")
            assert plain["grads"][step].keys() == overlap["grads"][step].keys()
            for param, grad in plain["grads"][step].items():
                assert_bitwise(grad, overlap["grads"][step][param], f"{where} {param}")
        assert not torch.equal(plain["losses"][0], unpacked["losses"][0])  # the boundaries change the numbers


@pytest.mark.parametrize("name", sorted(CASES))
def test_packed_microbatches_run_through_the_plan_bitwise_equal(name):
    check_packed(name, CASES[name])


@pytest.mark.gpu
def test_packed_microbatches_with_transformer_engine_attention_on_one_gpu():
    """Transformer Engine's attention runs THD itself (no stand-in): Megatron-Core's hybrid TE spec, 2 gloo ranks."""
    pytest.importorskip("transformer_engine.pytorch")
    import os

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    case = HybridCase(pattern="*E*E", te=True, rope=True, bf16=True, device="cuda", microbatches=3)
    check_packed("hybrid-te-*E*E", case, start_method="spawn")


def train_packed_engine(rank: int, world: int, case: McoreCase) -> dict:
    """The engine (``EPOverlapEngine``) on ``(tokens, labels, packed_seq_params)`` microbatches: plain and overlapped,
    and the same rows unpacked."""
    install_cpu_stubs()
    init_megatron(world)
    from ep_overlap_lab.engine import EPOverlapEngine
    from megatron.bridge.training.ep_overlap.mcore import chunk_for, mcore_ep_groups

    groups = mcore_ep_groups(timedelta(seconds=30))
    out = {}
    for arm in ("plain", "overlap", "plain_unpacked"):
        model = build_model(case)
        engine = EPOverlapEngine(chunk_for(model), groups, overlap=arm == "overlap")
        losses, grads = [], []
        for step in range(2):
            gen = torch.Generator().manual_seed(100 * step + rank)
            data = [tuple(torch.randint(0, 64, (2, 1, SEQ), generator=gen)) for _ in range(case.microbatches)]
            if arm != "plain_unpacked":
                data = [(tokens, labels, packed_params()) for tokens, labels in data]
            losses.append(torch.stack(engine.step(data).losses))
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            model.zero_grad(set_to_none=True)
        out[arm] = {"losses": losses, "grads": grads}
    return out


@pytest.mark.lab
@pytest.mark.parametrize("name", ["gpt-rope", "hybrid-*E*E-rope"])
def test_the_engine_runs_packed_microbatches_bitwise_equal(name):
    for rank in run_local_ranks(train_packed_engine, 2, (CASES[name],), collective_timeout_s=60):
        plain, overlap, unpacked = (rank.result[arm] for arm in ("plain", "overlap", "plain_unpacked"))
        for step in range(2):
            where = f"{name} engine rank {rank.rank} step {step}"
            assert_bitwise(plain["losses"][step], overlap["losses"][step], f"{where} losses")
            for param, grad in plain["grads"][step].items():
                assert_bitwise(grad, overlap["grads"][step][param], f"{where} {param}")
        assert not torch.equal(plain["losses"][0], unpacked["losses"][0])


@pytest.mark.lab
def test_the_reference_model_refuses_packed_microbatches_naming_the_fix():
    from ep_overlap_lab.moe_gpt import MoEGPTModel

    from .workers import Case

    model = MoEGPTModel(Case(world=1, ep=1).config())
    with pytest.raises(ValueError, match=r"MoEGPTModel: packed \(THD\) microbatches need a model whose attention"):
        model.with_packed_sequences(packed_params())


def _refused(rank: int, world: int, kind: str) -> str:
    install_cpu_stubs()
    init_megatron(world)
    from megatron.core.packed_seq_params import PackedSeqParams

    from ep_overlap_lab.engine import EPOverlapEngine
    from megatron.bridge.training.ep_overlap.mcore import chunk_for, mcore_ep_groups

    rows, packed = (2, packed_params()) if kind == "rows" else (1, PackedSeqParams(qkv_format="sbhd"))
    engine = EPOverlapEngine(chunk_for(build_model(McoreCase(packed=True))), mcore_ep_groups(timedelta(seconds=30)),
                             overlap=True)  # fmt: skip
    tokens = torch.zeros(rows, SEQ, dtype=torch.long)
    try:
        engine.step([(tokens, tokens, packed)])
    except ValueError as error:
        return str(error)
    return "accepted"


@pytest.mark.lab
@pytest.mark.parametrize(
    "kind, line",
    [
        ("rows", "microbatch 0: a packed (THD) microbatch is one row of concatenated documents, got tokens (2, 8)"),
        ("layout", "microbatch 0: packed_seq_params with qkv_format='sbhd'; fix: qkv_format='thd'"),
    ],
)
def test_the_engine_refuses_a_packed_microbatch_it_cannot_run(kind, line):
    for outcome in run_local_ranks(_refused, 2, (kind,)):
        assert line in outcome.result, outcome.result


def _params_of(documents: tuple[int, ...]):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens = torch.tensor(documents, dtype=torch.int32)
    longest = max(b - a for a, b in zip(documents[:-1], documents[1:]))
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)  # fmt: skip


def two_forwards_in_flight(rank: int, world: int) -> dict:
    """Two packed microbatches whose rotary embeddings differ (documents of 5 and 3 tokens, and one of 8) through the
    engine with edge pairing, whose warm-up runs both forwards at once: embed one, embed the other, then each one's
    layers and head (MTP layer included), against the plain path."""
    install_cpu_stubs()
    init_megatron(world)
    from ep_overlap_lab.engine import EPOverlapEngine
    from megatron.bridge.training.ep_overlap.mcore import chunk_for, mcore_ep_groups

    groups = mcore_ep_groups(timedelta(seconds=30))
    gen = torch.Generator().manual_seed(rank)
    data = [(*torch.randint(0, 64, (2, 1, SEQ), generator=gen), _params_of(d)) for d in (DOCUMENTS, (0, SEQ))]
    out = {}
    for arm in ("plain", "overlap"):
        model = build_model(McoreCase(packed=True, rope=True, mtp=True, microbatches=2))
        overlap = arm == "overlap"
        engine = EPOverlapEngine(chunk_for(model), groups, overlap=overlap, edge_pairing=overlap)
        result = engine.step(data)
        out[arm] = {
            "kinds": {str(step.kind) for step in engine.schedule(len(data))},
            "losses": torch.stack(result.losses),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        }
    return out


@pytest.mark.lab
def test_one_microbatchs_embed_does_not_change_what_another_forward_in_flight_reads():
    """The chunk keeps no microbatch's rotary embedding: before, each embed wrote its own on the chunk, and the first
    microbatch's MTP layer read the second's (a table as long as its row, which Megatron-Core's THD rotary reads as
    positions counted across the row's documents), so its gradients differed from the plain path's."""
    for rank in run_local_ranks(two_forwards_in_flight, 2, collective_timeout_s=60):
        plain, overlap = rank.result["plain"], rank.result["overlap"]
        assert "forward_pair" in overlap["kinds"]
        assert_bitwise(plain["losses"], overlap["losses"], f"rank {rank.rank} losses")
        assert plain["grads"].keys() == overlap["grads"].keys()
        for param, grad in plain["grads"].items():
            assert_bitwise(grad, overlap["grads"][param], f"rank {rank.rank} {param}")
