"""Selective recompute under the EP-overlap plan, checked against Megatron-Core 0.19's code.

``layernorm`` runs in both plans: Megatron-Core's recomputes it inside its nodes (``fine_grained_callables``: the
pre-MLP norm's checkpoint, dropped after the experts), and so does ours. ``moe`` runs in ours only: Megatron-Core's
config refuses it beside the overlap flag (its MoE layer checkpoints its whole forward), so a Bridge provider gets the
flag after those checks, and the plan replays each MoE part in the backward.
"""

import inspect
from types import SimpleNamespace

import pytest
from megatron.core.models.gpt import fine_grained_callables
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.bridge.training.ep_overlap.mcore.refusals import config_refusals


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


def test_moe_is_not_refused_and_a_provider_gets_the_flag_after_megatron_cores_checks(fake_versions):
    from megatron.bridge.training.comm_overlap import CommOverlapConfig, CommOverlapConfigError
    from megatron.bridge.training.ep_overlap.mcore import use_ep_overlap_schedule
    from megatron.bridge.training.ep_overlap.settings import apply_deferred

    from .test_comm_overlap_rules import DeferringProvider

    modules = dict(recompute_granularity="selective", recompute_modules=["moe", "layernorm"])
    assert config_refusals(SimpleNamespace(**modules)) == []
    with pytest.raises(AssertionError, match="disable moe in recompute_modules"):
        _mcore_config(["moe"])  # why the flag waits: Megatron-Core's own check
    requested = dict(tp_comm_overlap=False, overlap_moe_expert_parallel_comm=True)
    provider = DeferringProvider(**modules, _pre_wrap_hooks=[use_ep_overlap_schedule])
    CommOverlapConfig(**requested).setup(provider)
    assert provider.overlap_moe_expert_parallel_comm is False
    provider.finalize()  # Megatron-Core's checks pass: the flag is not on the config they see
    assert apply_deferred(provider) == {"overlap_moe_expert_parallel_comm": True}
    # Megatron-Core's own schedule cannot run it: the rule refuses it there, naming both fixes.
    with pytest.raises(CommOverlapConfigError, match=r"\[no_moe_recompute\].*use_ep_overlap_schedule"):
        CommOverlapConfig(**requested).setup(DeferringProvider(**modules))
