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
from datetime import timedelta

import pytest
import torch

from megatron.bridge.utils.multiprocess import run_local_ranks

from .mcore_cpu import UNEVEN_GATHERS, init_megatron, install_cpu_stubs
from .mcore_models import McoreCase, gpt_config
from .sp_norm import with_sequence_parallel_norms
from .test_mcore_hook import MICRO_BATCH, SEQ, bridge_style_forward_step
from .test_numerics import assert_bitwise

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
    from megatron.core import parallel_state

    from megatron.bridge.training.ep_overlap.mcore import get_forward_backward_func, use_ep_overlap_schedule

    out = {}
    for arm in ("plain", "overlap"):
        model = _sp_gpt(case, pipeline, expert_tensor)
        norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
        assert norms and all(m.weight.sequence_parallel for m in norms)  # every norm is the test's
        config = model.config
        config.batch_p2p_comm = False  # gloo pairs P2P in posting order
        if arm == "overlap":
            config.overlap_moe_expert_parallel_comm = True  # fp32: set after the build (Megatron-Core refuses it)
            config.delay_wgrad_compute = case.delay_wgrad
            use_ep_overlap_schedule([model], timeout=timedelta(seconds=30))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses, grads, phases = [], [], set()
        for step in range(case.steps):
            gen = torch.Generator().manual_seed(100 * step + parallel_state.get_data_parallel_rank())
            data = [
                tuple(torch.randint(0, 64, (2, MICRO_BATCH, SEQ), generator=gen)) for _ in range(case.microbatches)
            ]
            store = get_forward_backward_func(pp_size=pipeline, vp_size=None)(
                forward_step_func=bridge_style_forward_step, data_iterator=iter(data), model=[model],
                num_microbatches=case.microbatches, seq_length=SEQ, micro_batch_size=MICRO_BATCH, forward_only=False,
            )  # fmt: skip
            losses.append(torch.stack([logged["lm loss"] for logged in store]) if store else None)
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            if arm == "overlap":
                phases |= {str(r.phase) for r in model.build_schedule_plan.recorder.comm}
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        out[arm] = {"losses": losses, "grads": grads, "phases": phases, "uneven_gathers": UNEVEN_GATHERS[0]}
    return out


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
        for step in range(case.steps):
            where = f"rank {outcome.rank} step {step}"
            if plain["losses"][step] is not None:
                assert_bitwise(plain["losses"][step], overlap["losses"][step], f"{where} losses")
            assert plain["grads"][step].keys() == overlap["grads"][step].keys() and plain["grads"][step]
            for param, grad in plain["grads"][step].items():
                assert_bitwise(grad, overlap["grads"][step][param], f"{where} {param}")
        assert "paired" in overlap["phases"]
        if expert_tensor > 1:  # both arms gathered each rank's different token count over the expert-TP group
            assert 0 < plain["uneven_gathers"] < overlap["uneven_gathers"]
