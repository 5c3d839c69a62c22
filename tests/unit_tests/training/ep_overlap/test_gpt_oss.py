"""GPT-OSS's layer features under Megatron-Core's driver: the hook's plan bitwise equal to the plain path.

Each feature is set as Megatron-Bridge 0.6.2's GPT-OSS provider sets it (``GPTOSSBridge.provider_bridge``): linear
biases everywhere but the QKV projection (attention and expert biases, bias-dropout-add as Megatron-Core's layer does
it), learnable softmax sinks, a sliding window on every other layer, YaRN rotary positions, and the quick-GELU GLU
clamped at 7 with the linear half offset by 1, RMSNorm, no load balancing loss. On CPU (Megatron-Core's local specs):
the experts are a ``SequentialMLP`` (grouped GEMMs and the fused permute need Transformer Engine), so delayed wgrad
delays nothing there; the sizes are small (window 3 over 8 tokens). Two CPU ranks (EP 2), 2 Adam steps per arm,
``GPTModel`` and ``HybridModel``; and through the engine (its plain, overlapped, edge-paired and chunked arms).
"""

from dataclasses import replace

import pytest

from .bitwise import assert_steps_bitwise
from .local_ranks import run_local_ranks
from .mcore_models import HybridCase, McoreCase
from .test_mcore_equivalence import check_equal, train_mcore
from .test_mcore_hook import train_with_mcore_driver


def gpt_oss_fields() -> tuple:
    """The provider's GPT-OSS fields, as ``McoreCase.config`` pairs, with the CPU substitutions named above."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    return (
        ("normalization", "RMSNorm"),
        ("gated_linear_unit", True),
        ("add_bias_linear", True),
        ("add_qkv_bias", False),
        ("activation_func", quick_gelu),
        ("activation_func_clamp_value", 7.0),
        ("glu_linear_offset", 1.0),
        ("bias_activation_fusion", True),
        ("bias_dropout_fusion", False),
        ("softmax_type", "learnable"),
        ("window_size", (3, 0)),
        ("window_attn_skip_freq", 2),
        ("moe_router_pre_softmax", False),
    )


def _cases() -> dict:
    fields = gpt_oss_fields()
    gpt = McoreCase(layer_freq=(1, 1, 1), yarn=True, microbatches=3, config=fields)
    return {
        "gpt": gpt,
        "gpt-delayed-wgrad": replace(gpt, delay_wgrad=True),
        "gpt-mtp": replace(gpt, mtp=True),
        "hybrid-*E*E": HybridCase(pattern="*E*E", yarn=True, microbatches=3, config=fields),
    }


@pytest.mark.parametrize("name", ["gpt", "gpt-delayed-wgrad", "gpt-mtp", "hybrid-*E*E"])
def test_gpt_oss_features_under_the_hook_are_bitwise_equal(name):
    case = _cases()[name]
    for outcome in run_local_ranks(train_with_mcore_driver, case.world, (case,)):
        plain, overlap = outcome.result["plain"], outcome.result["overlap"]
        assert_steps_bitwise(plain, overlap, case.steps, outcome.rank)
        assert all(("paired", 1) in overlap["phases"][step] for step in range(case.steps))
        trained = plain["grads"][-1]
        # The features are live: biases in attention and experts, the sinks, all with gradients.
        for part in ("self_attention.linear_proj.bias", "experts.local_experts.0.linear_fc1.bias", "softmax_offset"):
            assert any(part in n and g.abs().sum() > 0 for n, g in trained.items()), part


@pytest.mark.lab
@pytest.mark.parametrize("name", ["gpt", "hybrid-*E*E"])
def test_gpt_oss_features_through_the_engine_are_bitwise_equal(name):
    case = replace(_cases()[name], steps=1)
    check_equal(case, run_local_ranks(train_mcore, case.world, (case,)))
