"""Context parallelism under Megatron-Core's driver: the hook's plan bitwise equal to the plain path.

Four CPU ranks, CP 2 x EP 2: the two context-parallel ranks of a data-parallel rank hold halves of the same
sequences, cut as Bridge's ``get_batch`` cuts them (Megatron-Core's ``get_batch_on_this_cp_rank``, two chunks each),
and the expert-parallel group spans the data- and context-parallel ranks. Megatron-Core's local attention refuses
context parallelism (Transformer Engine's takes it): a test-only core attention takes it (``cp_attention.py``),
checked here against whole-sequence attention. Each arm trains 2 Adam steps through ``get_forward_backward_func()``;
every loss and every gradient on every rank must be bitwise equal. A plan whose attention cannot take context
parallelism is refused when it is built.
"""

from dataclasses import replace
from datetime import timedelta
from functools import partial

import pytest
import torch

from .bitwise import assert_steps_bitwise
from .cp_attention import ContextParallelAttention, with_context_parallel_attention, zigzag_positions
from .local_ranks import run_local_ranks
from .mcore_arms import train_plain_and_hook
from .mcore_cpu import init_megatron, install_cpu_stubs
from .mcore_models import McoreCase, gpt_config
from .test_mcore_hook import SEQ, masked_token_loss

CP = 2


def _cp_gpt(case: McoreCase, local_attention: bool = False):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    config = gpt_config(case, context_parallel_size=1 if local_attention else CP)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    if not local_attention:
        spec = with_context_parallel_attention(spec)
    torch.manual_seed(1234)
    model = GPTModel(config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=SEQ,
                     position_embedding_type="rope" if case.rope else "learned_absolute",
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())  # fmt: skip
    model.config.context_parallel_size = CP  # the local attention was built without it (it refuses it)
    return model


def cp_forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """Bridge's ``forward_step`` in small: the whole sequences, then this rank's part of them."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    tokens, labels = next(data_iterator)
    batch = {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": (labels % 5 != 0).float(),
        "position_ids": torch.arange(SEQ)[None].expand_as(tokens),
    }
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=parallel_state.get_context_parallel_group())
    inputs = dict(position_ids=batch["position_ids"], attention_mask=None, labels=batch["labels"])
    loss_func = partial(masked_token_loss, batch["loss_mask"])
    if return_schedule_plan:
        return model.build_schedule_plan(batch["tokens"], **inputs, loss_mask=batch["loss_mask"]), loss_func
    return model(input_ids=batch["tokens"], **inputs, loss_mask=batch["loss_mask"]), loss_func


def train_cp(rank: int, world: int, case: McoreCase) -> dict:
    install_cpu_stubs()
    init_megatron(case.world, context=CP)
    from megatron.core import parallel_state

    assert parallel_state.get_expert_model_parallel_world_size() == case.world
    return train_plain_and_hook(lambda: _cp_gpt(case), case, cp_forward_step, seq_length=SEQ // CP)


GPT = McoreCase(layer_freq=(1, 0, 1), microbatches=4, steps=2)
CASES = {
    "cp2-ep2": GPT,
    "cp2-ep2-rope-delayed-shared": replace(GPT, rope=True, delay_wgrad=True, shared_ffn=16),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_context_parallelism_under_the_hook_is_bitwise_equal(name):
    case = CASES[name]
    for outcome in run_local_ranks(train_cp, CP * case.world, (case,)):
        plain, overlap = outcome.result["plain"], outcome.result["overlap"]
        assert all(losses is not None for losses in plain["losses"])  # no pipeline: every rank reports its losses
        assert_steps_bitwise(plain, overlap, case.steps, outcome.rank)
        assert "paired" in overlap["phases"]


def _attention_against_whole_sequence(rank: int, world: int) -> float:
    group = torch.distributed.group.WORLD
    gen = torch.Generator().manual_seed(7)
    query, key, value = (torch.randn(8, 2, 4, 3, generator=gen, requires_grad=True) for _ in range(3))
    mine = torch.cat([zigzag_positions(4, world, rank)])
    config = type("Config", (), {"kv_channels": 3})()
    ours = ContextParallelAttention(config, 1, None, "self", pg_collection=type("P", (), {"cp": group})())
    local = ours(query[mine].detach().requires_grad_(), key[mine], value[mine], None)
    scores = torch.einsum("qbhd,kbhd->bhqk", query, key) / 3**0.5
    scores = scores.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    whole = torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), value).reshape(8, 2, -1)
    return float((local - whole[mine]).abs().max())


def test_the_test_attention_is_whole_sequence_causal_attention():
    for outcome in run_local_ranks(_attention_against_whole_sequence, CP):
        assert outcome.result < 1e-6, outcome.result


def _local_attention_under_cp(rank: int, world: int) -> str:
    install_cpu_stubs()
    init_megatron(2, context=CP)
    from megatron.bridge.training.ep_overlap.mcore import use_ep_overlap_schedule

    model = _cp_gpt(GPT, local_attention=True)
    model.config.overlap_moe_expert_parallel_comm = True
    try:
        use_ep_overlap_schedule([model], timeout=timedelta(seconds=30))
    except ValueError as error:
        return str(error)
    return "accepted"


def test_the_plan_refuses_an_attention_that_cannot_take_context_parallelism():
    for outcome in run_local_ranks(_local_attention_under_cp, 4):
        assert "DotProductAttention" in outcome.result and "context_parallel_size" in outcome.result, outcome.result
