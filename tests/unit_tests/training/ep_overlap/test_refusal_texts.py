"""The selective-recompute refusal says what Megatron-Core 0.19 does with each module, checked against its code.

``recompute_stepped_modules`` refuses ``moe``: Megatron-Core's config refuses it beside the overlap flag (its MoE layer
checkpoints its whole forward). ``layernorm`` runs in both plans: Megatron-Core's recomputes it inside its nodes
(``fine_grained_callables``: the pre-MLP norm's checkpoint, dropped after the experts), and so does ours.
"""

import inspect
from types import SimpleNamespace

import pytest
from megatron.core.models.gpt import fine_grained_callables
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.bridge.training.ep_overlap.mcore.refusals import config_refusals


def _refusal(modules: list[str]) -> str:
    config = SimpleNamespace(recompute_granularity="selective", recompute_modules=modules)
    lines = dict(config_refusals(config))
    return lines["recompute_stepped_modules"]


def _mcore_config(modules: list[str]) -> TransformerConfig:
    return TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=4, moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=2, bf16=True, overlap_moe_expert_parallel_comm=True,
        recompute_granularity="selective", recompute_modules=modules,
    )  # fmt: skip


def test_layernorm_is_not_refused_as_megatron_cores_own_plan_recomputes_it_in_its_nodes():
    config = SimpleNamespace(recompute_granularity="selective", recompute_modules=["layernorm", "core_attn"])
    assert config_refusals(config) == []
    # True of the installed Megatron-Core: its config takes it with the overlap on, its nodes recompute the norm.
    assert "layernorm" in _mcore_config(["layernorm"]).recompute_modules
    nodes = inspect.getsource(fine_grained_callables)
    assert "pre_mlp_norm_checkpoint.checkpoint" in nodes and "discard_output_and_register_recompute" in nodes


def test_the_moe_refusal_says_megatron_core_checkpoints_the_whole_moe_forward_and_refuses_it_with_the_overlap():
    line = _refusal(["moe", "layernorm"])
    assert "Megatron-Core recomputes 'moe' by checkpointing the MoE layer's whole forward" in line
    assert "layernorm" not in line.split(": ", 1)[1] and "fix: drop ['moe']" in line
    with pytest.raises(AssertionError, match="disable moe in recompute_modules"):
        _mcore_config(["moe"])
