"""Tensor parallelism with sequence parallelism under Megatron-Core's driver: the hook's plan bitwise equal to the
plain path.

Four CPU ranks: TP 2 x EP 2 (the two data-parallel ranks hold the expert-parallel group), upstream's
``tp2_pp1_te_a2a_ovlp`` shape on a small model; the same with expert TP 2 (the experts' weights split over the
tensor-parallel pair, which gathers the tokens each receives: a different count per rank, so the CPU fixture pads
gloo's gather); and eight for TP 2 x EP 2 x PP 2 (the plain 1F1B pipeline).
Megatron-Core's local norm refuses sequence parallelism (Transformer Engine's takes it): here a test-only norm takes it
(``sp_norm.py``), marking its weights as Transformer Engine's are marked, so the layers are Megatron-Core's own with
``sequence_parallel=True`` (the column- and row-parallel linears gather and scatter the sequence, the embedding
scatters it, the output layer gathers it). Each arm trains 2 Adam steps through ``get_forward_backward_func()``;
every loss and every gradient on every rank must be bitwise equal.
"""

from dataclasses import replace

import pytest
import torch

from .bitwise import assert_steps_bitwise
from .local_ranks import run_local_ranks
from .mcore_arms import train_plain_and_hook
from .mcore_cpu import UNEVEN_GATHERS, init_megatron, install_cpu_stubs
from .mcore_models import McoreCase, gpt_config
from .sp_norm import with_sequence_parallel_norms
from .test_mcore_hook import SEQ, bridge_style_forward_step

TP = 2


def _sp_gpt(case: McoreCase, pipeline: int, expert_tensor: int):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    fields = dict(tensor_model_parallel_size=TP, sequence_parallel=True, expert_tensor_parallel_size=expert_tensor)
    if pipeline > 1:
        fields |= dict(pipeline_model_parallel_size=pipeline, pipeline_dtype=torch.float32)
    config = gpt_config(case, **fields)
    spec = with_sequence_parallel_norms(get_gpt_decoder_block_spec(config, use_transformer_engine=False))
    torch.manual_seed(1234 + parallel_state.get_tensor_model_parallel_rank())
    return GPTModel(config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=SEQ,
                    position_embedding_type="rope" if case.rope else "learned_absolute",
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage())  # fmt: skip


def train_tp(rank: int, world: int, case: McoreCase, pipeline: int, expert_tensor: int) -> dict:
    install_cpu_stubs()
    init_megatron(case.world, pipeline, None, tensor=TP, expert_tensor=expert_tensor)

    def build():
        model = _sp_gpt(case, pipeline, expert_tensor)
        norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
        assert norms and all(m.weight.sequence_parallel for m in norms)  # every norm is the test's
        return model

    return train_plain_and_hook(build, case, bridge_style_forward_step, extra=lambda: {"uneven": UNEVEN_GATHERS[0]})


GPT = McoreCase(layer_freq=(1, 0, 1, 1), microbatches=4, steps=2)
CASES = {  # name: (case, pipeline stages, expert tensor parallelism)
    "tp2-sp-ep2": (GPT, 1, 1),
    "tp2-sp-ep2-rope-delayed": (replace(GPT, rope=True, delay_wgrad=True), 1, 1),
    "tp2-sp-ep2-pp2-1f1b": (GPT, 2, 1),
    # The second stage computes RoPE for the activation it receives (its part of the sequence), as the model does.
    "tp2-sp-ep2-pp2-1f1b-rope": (replace(GPT, rope=True), 2, 1),
    "tp2-sp-etp2-ep2": (GPT, 1, 2),
    "tp2-sp-etp2-ep2-delayed-shared": (replace(GPT, delay_wgrad=True, shared_ffn=16), 1, 2),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_tensor_and_sequence_parallelism_under_the_hook_are_bitwise_equal(name):
    case, pipeline, expert_tensor = CASES[name]
    for outcome in run_local_ranks(train_tp, 2 * TP * pipeline, (case, pipeline, expert_tensor)):
        plain, overlap = outcome.result["plain"], outcome.result["overlap"]
        assert_steps_bitwise(plain, overlap, case.steps, outcome.rank)
        assert "paired" in overlap["phases"]
        if expert_tensor > 1:  # both arms gathered each rank's different token count over the expert-TP group
            assert 0 < plain["uneven"] < overlap["uneven"]
