"""Every field of the reference model's config either acts or is refused by name: none is accepted and ignored."""

import dataclasses
import math

import pytest
import torch

from ep_overlap_lab.moe_gpt import MoEGPTModel
from ep_overlap_lab.moe_gpt.config import DERIVED, ELSEWHERE, READ, MoEGPTConfig, model_feature_problems

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
        dict(moe_expert_capacity_factor=1.0),
        dict(normalization="ScaleNorm"),
        dict(hidden_dropout=0.1),
        dict(qk_layernorm=True),
        dict(moe_router_load_balancing_type="sinkhorn"),
    ],
    ids=lambda fields: ",".join(fields),
)
def test_a_field_the_reference_model_would_ignore_is_refused_by_name(fields):
    config = MoEGPTConfig(**BASE, **fields)
    problems = model_feature_problems(config)
    (named,) = fields
    assert len(problems) == 1 and problems[0].startswith(f"{named}="), problems
    with pytest.raises(ValueError, match=named):
        MoEGPTModel(config)


@pytest.mark.parametrize("groups, width", [(4, 8), (2, 8), (1, 8), (2, 5)], ids=["mha", "gqa-2", "mqa", "gqa-kv5"])
def test_grouped_query_attention_and_head_width_compute_as_defined(groups, width):
    # H = 4 query heads; G key/value heads, each shared by H / G consecutive query heads; d = kv_channels wide;
    # softmax scale 1 / sqrt(d) (Megatron-Core's definitions), checked against attention written out head by head.
    from ep_overlap_lab.moe_gpt.attention import Attention

    config = MoEGPTConfig(**BASE, num_query_groups=groups, kv_channels=width, seq_length=6)
    assert model_feature_problems(config) == []
    torch.manual_seed(0)
    attention = Attention(config, "attention")
    torch.nn.init.normal_(attention.proj.weight)  # built alone, outside the model that initializes it
    H, d, S = 4, width, 6
    assert attention.qkv.weight.shape == (1, 32, (H + 2 * groups) * d)
    assert attention.proj.weight.shape == (1, H * d, 32)
    qkv_TQ = torch.randn(2 * S, (H + 2 * groups) * d)
    got_TD = attention.attend(qkv_TQ)
    q, k, v = qkv_TQ.split([H * d, groups * d, groups * d], dim=-1)
    heads = []
    for b in range(2):
        rows = slice(b * S, (b + 1) * S)
        per_head = []
        for h in range(H):
            g = h // (H // groups)
            q_Sd, k_Sd, v_Sd = (t[rows].view(S, -1, d)[:, i] for t, i in ((q, h), (k, g), (v, g)))
            scores_SS = q_Sd @ k_Sd.T / math.sqrt(d)
            scores_SS = scores_SS.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
            per_head.append(torch.softmax(scores_SS, dim=-1) @ v_Sd)
        heads.append(torch.cat(per_head, dim=-1))
    want_TD = attention.proj(torch.cat(heads))
    torch.testing.assert_close(got_TD, want_TD, rtol=1e-5, atol=1e-6)


def test_fewer_key_value_heads_change_the_loss():
    from ep_overlap_lab.moe_gpt import MoEGPTModel

    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    losses = []
    for groups in (4, 2):
        config = MoEGPTConfig(**BASE, num_query_groups=groups, seq_length=8, vocab_size=64, moe_layer_freq=[0, 0])
        losses.append(MoEGPTModel(config)(tokens, tokens, 16.0).item())
    assert losses[0] != losses[1]


def test_rmsnorm_normalizes_as_defined_and_changes_the_loss():
    from ep_overlap_lab.moe_gpt import MoEGPTModel

    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    losses = {}
    for kind in ("LayerNorm", "RMSNorm"):
        config = MoEGPTConfig(**BASE, normalization=kind, seq_length=8, vocab_size=64, moe_layer_freq=[0, 0])
        model = MoEGPTModel(config)
        losses[kind] = model(tokens, tokens, 16.0).item()
    norm = model.layers[0].ln1  # the RMSNorm model's: x / sqrt(mean(x^2) + eps) * weight
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 32))
        x_TD = torch.randn(5, 32)
        want_TD = x_TD * torch.rsqrt(x_TD.pow(2).mean(-1, keepdim=True) + config.layernorm_epsilon) * norm.weight
        torch.testing.assert_close(norm(x_TD), want_TD)
    assert losses["LayerNorm"] != losses["RMSNorm"]
