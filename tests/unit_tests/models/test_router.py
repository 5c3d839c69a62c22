"""The reference model's router: Megatron-Core's score functions, and aux-loss-free load balancing (expert bias)."""

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

from ep_overlap_lab.moe_gpt import MoEGPTConfig, MoEGPTModel
from ep_overlap_lab.moe_gpt.config import router_problems
from ep_overlap_lab.multiprocess import single_process_groups


def _config(**overrides) -> MoEGPTConfig:
    values = dict(
        num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=16, moe_ffn_hidden_size=8,
        num_moe_experts=4, moe_router_topk=2, seq_length=8, vocab_size=32, add_bias_linear=False,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.1,
    )  # fmt: skip
    values.update(overrides)
    return MoEGPTConfig(**values)


@pytest.mark.parametrize("topk", [1, 2])
# Megatron-Core allows expert bias with sigmoid scores only.
@pytest.mark.parametrize("score_function, with_bias", [("softmax", False), ("sigmoid", False), ("sigmoid", True)])
def test_routing_matches_megatron_core(score_function, with_bias, topk):
    config = _config(
        moe_router_topk=topk,
        moe_router_score_function=score_function,
        moe_router_enable_expert_bias=with_bias,
        moe_router_pre_softmax=topk == 1,
    )
    layer = MoEGPTModel(config).layers[0]
    if with_bias:  # large enough to change which experts win
        layer.expert_bias_E.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    logits_TE = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    probs_TK, experts_TK = layer._route(logits_TE)
    expected_TE, chosen_TE = topk_routing_with_score_function(
        logits_TE, topk, use_pre_softmax=config.moe_router_pre_softmax, score_function=score_function,
        expert_bias=layer.expert_bias_E if with_bias else None,
    )  # fmt: skip
    chosen_TK = torch.zeros_like(chosen_TE).scatter(1, experts_TK, True)
    assert torch.equal(chosen_TK, chosen_TE)
    torch.testing.assert_close(probs_TK, expected_TE.gather(1, experts_TK), rtol=1e-6, atol=1e-7)
    if with_bias:  # the bias picked the experts, it does not weight them
        assert not torch.equal(experts_TK, torch.topk(torch.sigmoid(logits_TE), topk, dim=-1).indices)


def test_expert_bias_moves_toward_the_experts_that_got_fewer_tokens():
    model = MoEGPTModel(_config(bf16=True))
    layer = model.layers[0]
    assert layer.expert_bias_E.dtype == torch.float32  # small steps would round away in bf16
    tokens_BS = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # evaluation and forward-only steps do not count
        model(tokens_BS, tokens_BS, 16.0)
    assert all(int(layer.tokens_per_expert_E.sum()) == 0 for layer in model.layers)
    model(tokens_BS, tokens_BS, 16.0)
    counts = [layer.tokens_per_expert_E.clone() for layer in model.layers]
    assert all(int(c.sum()) == 16 * 2 for c in counts)  # every token counted once per chosen expert
    model.update_router_biases(single_process_groups())
    for layer, counts_E in zip(model.layers, counts):
        expected = torch.sign(counts_E.float().mean() - counts_E.float()) * 0.1
        assert torch.equal(layer.expert_bias_E, expected)
        assert int(layer.tokens_per_expert_E.sum()) == 0  # the next step counts afresh


def test_without_expert_bias_there_is_nothing_to_update():
    model = MoEGPTModel(_config(moe_router_enable_expert_bias=False))
    assert model.layers[0].expert_bias_E is None
    model.update_router_biases(single_process_groups())


def test_router_settings_it_cannot_run_are_one_line_each_with_the_fix():
    assert router_problems(_config()) == []
    config = _config()
    config.moe_router_score_function, config.moe_router_bias_update_rate = "softmax", 0.0
    problems = router_problems(config)
    assert [line.split("=")[0] for line in problems] == [
        "moe_router_enable_expert_bias",
        "moe_router_bias_update_rate",
    ]
    assert "set moe_router_score_function='sigmoid'" in problems[0]
    config.moe_router_score_function = "sqrtsoftplus"
    assert router_problems(config)[0].startswith("moe_router_score_function='sqrtsoftplus': ")
    with pytest.raises(ValueError, match="layer0: moe_router_score_function='sqrtsoftplus'"):
        MoEGPTModel(config)
