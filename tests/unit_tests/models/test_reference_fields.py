"""Every field of the reference model's config either acts or is refused by name: none is accepted and ignored."""

import dataclasses

import pytest

from megatron.bridge.models.moe_gpt import MoEGPTModel
from megatron.bridge.models.moe_gpt.config import DERIVED, ELSEWHERE, READ, MoEGPTConfig, model_feature_problems

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_moe_experts=4, add_bias_linear=False)


def test_the_field_sets_are_disjoint_and_name_real_fields():
    names = {field.name for field in dataclasses.fields(MoEGPTConfig)}
    assert not READ & ELSEWHERE and not READ & DERIVED and not ELSEWHERE & DERIVED
    assert (READ | ELSEWHERE | DERIVED) - names == set()
    assert len(names - READ - ELSEWHERE - DERIVED) > 150  # the rest keep their defaults, checked one by one


def test_a_default_config_has_no_problem():
    assert model_feature_problems(MoEGPTConfig(**BASE)) == []


@pytest.mark.parametrize(
    "fields",
    [
        dict(moe_z_loss_coeff=1e-3),
        dict(moe_expert_capacity_factor=1.0),
        dict(moe_shared_expert_intermediate_size=16),
        dict(num_query_groups=2),
        dict(kv_channels=4),
        dict(normalization="RMSNorm"),
        dict(hidden_dropout=0.1),
        dict(qk_layernorm=True),
        dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2),
        dict(moe_router_load_balancing_type="sinkhorn"),
    ],
    ids=lambda fields: ",".join(fields),
)
def test_a_field_the_reference_model_would_ignore_is_refused_by_name(fields):
    config = MoEGPTConfig(**BASE, **fields)
    problems = model_feature_problems(config)
    named = [name for name in fields if name != "moe_router_load_balancing_type" or len(fields) == 1]
    assert len(problems) == 1 and problems[0].startswith(f"{named[-1]}="), problems
    with pytest.raises(ValueError, match=named[-1]):
        MoEGPTModel(config)
