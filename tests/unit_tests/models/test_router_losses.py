"""The reference model's router losses and shared experts compute what Megatron-Core defines, written out here."""

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from ep_overlap_lab.moe_gpt import MoEGPTConfig, MoEGPTModel
from ep_overlap_lab.moe_gpt.config import model_feature_problems

S, B, E, K = 8, 3, 4, 2
BASE = dict(
    num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=16, moe_ffn_hidden_size=8,
    num_moe_experts=E, moe_router_topk=K, seq_length=S, vocab_size=32, add_bias_linear=False,
    moe_layer_freq=[0, 1],  # the MoE layer last: no other router loss reaches its router's gradient
)  # fmt: skip


def _switch(scores_TE: torch.Tensor, coeff: float) -> torch.Tensor:
    """coeff * E / (K * T^2) * sum_e(P_e * f_e): P_e the summed scores of expert e, f_e the tokens whose top-k
    scores hold it."""
    T = scores_TE.shape[0]
    f_E = torch.zeros_like(scores_TE).scatter(1, scores_TE.topk(K, dim=-1).indices, 1.0).sum(0)
    return coeff * E / (K * T * T) * (scores_TE.sum(0) * f_E).sum()


def _by_hand(kind: str, logits_TE: torch.Tensor, score_function: str, coeff: float) -> torch.Tensor:
    if kind == "z":
        return coeff * torch.logsumexp(logits_TE, dim=-1).square().mean()
    if score_function == "softmax":
        scores_TE = torch.softmax(logits_TE.float(), dim=-1)
    else:
        sig_TE = torch.sigmoid(logits_TE.float())
        scores_TE = sig_TE / (sig_TE.sum(-1, keepdim=True) + 1e-20)
    if kind == "aux_loss":
        return _switch(scores_TE, coeff)
    return sum(_switch(scores_TE[b * S : (b + 1) * S], coeff) for b in range(B)) / B  # per sequence, averaged


def _router_grad(config: MoEGPTConfig, tokens_BS: torch.Tensor, per_token: float) -> tuple[torch.Tensor, ...]:
    model = MoEGPTModel(config, seed=3)
    router = model.layers[1].router
    seen = {}
    router.register_forward_hook(lambda module, args, out: seen.update(n=args[0].detach()))
    model(tokens_BS, tokens_BS, per_token).backward()
    return router.weight.grad.clone(), router.weight.detach().clone(), seen["n"]


CASES = {
    "aux-softmax": ("aux_loss", "softmax", dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.7)),
    "aux-sigmoid": ("aux_loss", "sigmoid", dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.7)),
    "seq-aux-softmax": (
        "seq_aux_loss",
        "softmax",
        dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.7),
    ),
    "z-loss": ("z", "softmax", dict(moe_z_loss_coeff=0.3)),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("per_token", [False, True], ids=["per-microbatch", "per-token-loss"])
def test_a_router_loss_adds_its_definitions_gradient_at_the_set_scale(name, per_token):
    kind, score_function, fields = CASES[name]
    tokens_BS = torch.randint(0, 32, (B, S), generator=torch.Generator().manual_seed(1))
    base = dict(BASE, moe_router_score_function=score_function, calculate_per_token_loss=per_token)
    found = MoEAuxLossAutoScaler.main_loss_backward_scale
    scale = 0.25
    try:
        MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor([scale])
        with_loss, weight_EF, n_TF = _router_grad(MoEGPTConfig(**base, **fields), tokens_BS, float(B * S))
        without, _, _ = _router_grad(MoEGPTConfig(**base), tokens_BS, float(B * S))
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = found
    w_EF = weight_EF.requires_grad_()
    coeff = next(v for k, v in fields.items() if k.endswith("coeff"))
    # With calculate_per_token_loss the router multiplies its losses by the microbatch's token count.
    defined = _by_hand(kind, n_TF @ w_EF.T, score_function, coeff) * (B * S if per_token else 1)
    (expected_EF,) = torch.autograd.grad(scale * defined, w_EF)
    assert expected_EF.abs().max() > 10 * without.abs().max() * 1e-4  # the loss's part is far above the tolerance
    torch.testing.assert_close(with_loss - without, expected_EF, rtol=1e-4, atol=1e-7)


def test_the_losses_leave_the_forward_and_evaluation_alone():
    tokens_BS = torch.randint(0, 32, (B, S), generator=torch.Generator().manual_seed(2))
    fields = dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.7, moe_z_loss_coeff=0.3)
    plain, lossy = MoEGPTModel(MoEGPTConfig(**BASE), seed=3), MoEGPTModel(MoEGPTConfig(**BASE, **fields), seed=3)
    assert torch.equal(plain(tokens_BS, tokens_BS, 24.0), lossy(tokens_BS, tokens_BS, 24.0))
    lossy.eval()  # evaluation attaches no loss, as Megatron-Core's router in eval mode
    lossy(tokens_BS, tokens_BS, 24.0).backward()
    plain(tokens_BS, tokens_BS, 24.0).backward()
    assert torch.equal(lossy.layers[1].router.weight.grad, plain.layers[1].router.weight.grad)


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "swiglu"])
def test_shared_experts_add_an_mlp_of_the_routers_input_before_the_residual(gated):
    config = MoEGPTConfig(**BASE, gated_linear_unit=gated, moe_shared_expert_intermediate_size=12)
    assert model_feature_problems(config) == []
    shared = MoEGPTModel(config, seed=3)
    routed = MoEGPTModel(MoEGPTConfig(**BASE, gated_linear_unit=gated), seed=3)
    # Shared experts are built after everything else: every other weight is the same.
    assert {k for k in shared.state_dict() if "shared_fc" not in k} == set(routed.state_dict())
    assert all(torch.equal(v, shared.state_dict()[k]) for k, v in routed.state_dict().items())
    layer, other = shared.layers[1], routed.layers[1]
    assert layer.shared_fc1.weight.shape == (1, 16, 24 if gated else 12)
    assert layer.shared_fc2.weight.shape == (1, 12, 16)
    x_TD = torch.randn(B * S, 16, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for linear in (layer.shared_fc1, layer.shared_fc2):  # well above the init's scale, so the MLP shows
            linear.weight.normal_(generator=torch.Generator().manual_seed(5))
        n_TD = layer.ln2(x_TD + layer.attention(layer.ln1(x_TD)))
        up_TF = n_TD @ layer.shared_fc1.weight[0]
        act_TF = F.silu(up_TF[:, :12]) * up_TF[:, 12:] if gated else F.gelu(up_TF)
        mlp_TD = act_TF @ layer.shared_fc2.weight[0]
        torch.testing.assert_close(layer(x_TD) - other(x_TD), mlp_TD, rtol=1e-4, atol=1e-5)
    assert mlp_TD.abs().max() > 0.1


@pytest.mark.parametrize(
    "fields, named",
    [
        (
            dict(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.1),
            "moe_router_load_balancing_type",
        ),
        (dict(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.1), "moe_aux_loss_coeff"),
        (dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=-1.0), "moe_aux_loss_coeff"),
        (dict(moe_z_loss_coeff=float("nan")), "moe_z_loss_coeff"),
        (dict(moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True), "moe_shared_expert_gate"),
    ],
    ids=["global-aux", "coeff-without-type", "negative-coeff", "nan-z", "gate"],
)
def test_what_the_router_cannot_compute_or_would_ignore_is_refused_by_name(fields, named):
    problems = model_feature_problems(MoEGPTConfig(**BASE, **fields))
    assert len(problems) == 1 and problems[0].startswith(f"{named}="), problems
