"""The selective-recompute refusal says what Megatron-Core 0.19 does with each module, checked against its code.

``recompute_stepped_modules`` refuses ``moe`` and ``layernorm``. Megatron-Core's config refuses ``moe`` beside the
overlap flag (its MoE layer checkpoints its whole forward), and takes ``layernorm``, which its own overlapped plan
recomputes inside its nodes (``fine_grained_callables``: the pre-MLP norm's checkpoint, released after the combine).
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


def test_the_layernorm_refusal_says_megatron_cores_own_plan_recomputes_it_in_its_nodes():
    line = _refusal(["layernorm"])
    # Finding 7 of issue 63: it said Megatron-Core recomputes it "from ... the transformer layer's forward".
    assert "forward" not in line.split("; fix:")[0], line
    assert "Megatron-Core's own overlapped plan recomputes 'layernorm' inside its layer nodes" in line
    assert "fix: drop ['layernorm'] from recompute_modules" in line
    # True of the installed Megatron-Core: its config takes it with the overlap on, its nodes recompute the norm.
    assert "layernorm" in _mcore_config(["layernorm"]).recompute_modules
    nodes = inspect.getsource(fine_grained_callables)
    assert "pre_mlp_norm_checkpoint.checkpoint" in nodes and "discard_output_and_register_recompute" in nodes


def test_the_moe_refusal_says_megatron_core_checkpoints_the_whole_moe_forward_and_refuses_it_with_the_overlap():
    line = _refusal(["moe", "layernorm"])
    assert "Megatron-Core recomputes 'moe' by checkpointing the MoE layer's whole forward" in line
    assert "'layernorm' inside its layer nodes" in line and "fix: drop ['layernorm', 'moe']" in line
    with pytest.raises(AssertionError, match="disable moe in recompute_modules"):
        _mcore_config(["moe"])
