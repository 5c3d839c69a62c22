"""The Transformer Engine adapter, against a stand-in ``transformer_engine.pytorch`` (TE needs CUDA to install).

The stand-in has TE's constructor, per-group ``weight{g}`` [N, K] layout and ``backward_dw()``; these tests check
our side: backend choice and its log line, weight layout, delegation, pending count and grad-ready hooks.
"""

import logging
import sys
import types

import pytest
import torch

from ep_overlap_lab.moe_gpt import grouped_linear as gl


class _DelayedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, owner, *weights):
        ctx.save_for_backward(x)
        ctx.owner = owner
        return torch.cat([x_g @ w.t() for x_g, w in zip(torch.split(x, owner.splits), weights)])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        owner = ctx.owner
        owner.store.append((x, grad, owner.splits))
        weights = owner.weights()
        dx = torch.cat([g @ w for g, w in zip(torch.split(grad, owner.splits), weights)])
        return (dx, None, *[None] * len(weights))


class FakeTEGroupedLinear(torch.nn.Module):
    def __init__(self, num_gemms, in_features, out_features, bias, params_dtype, device, delay_wgrad_compute):
        super().__init__()
        assert bias is False and device == "cuda"
        self.num_gemms, self.delay, self.store = num_gemms, delay_wgrad_compute, []
        for g in range(num_gemms):
            setattr(self, f"weight{g}", torch.nn.Parameter(torch.zeros(out_features, in_features, dtype=params_dtype)))

    def weights(self):
        return [getattr(self, f"weight{g}") for g in range(self.num_gemms)]

    def forward(self, x, m_splits):
        self.splits = m_splits
        if self.delay:
            return _DelayedFn.apply(x, self, *self.weights())
        return torch.cat([x_g @ w.t() for x_g, w in zip(torch.split(x, m_splits), self.weights())])

    def backward_dw(self):
        x, grad, splits = self.store.pop(0)
        for w, x_g, g_g in zip(self.weights(), torch.split(x, splits), torch.split(grad, splits)):
            dw = g_g.t() @ x_g
            w.grad = dw if w.grad is None else w.grad + dw


@pytest.fixture
def fake_te(monkeypatch):
    pytorch = types.ModuleType("transformer_engine.pytorch")
    pytorch.GroupedLinear = FakeTEGroupedLinear
    package = types.ModuleType("transformer_engine")
    package.pytorch = pytorch
    monkeypatch.setitem(sys.modules, "transformer_engine", package)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", pytorch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def build(delay=False, **kwargs):
    options = dict(name="layer0.experts.fc1", use_transformer_engine=True, delay_wgrad=delay, dtype=torch.float32)
    options.update(kwargs)
    return gl.make_expert_linear(3, 16, 8, **options)


def test_transformer_engine_is_chosen_and_logged(fake_te, caplog):
    with caplog.at_level(logging.INFO):
        linear = build()
    assert isinstance(linear, gl.TEGroupedLinear)
    assert "layer0.experts.fc1: using Transformer Engine GroupedLinear" in caplog.text


def test_pure_torch_without_cuda(fake_te, monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.INFO):
        assert isinstance(build(), gl.GroupedLinear)
    assert "no CUDA device" in caplog.text


def test_pure_torch_without_transformer_engine(caplog):
    with caplog.at_level(logging.INFO):
        assert isinstance(build(), gl.GroupedLinear)
    assert "not importable" in caplog.text or "no CUDA device" in caplog.text


def test_pure_torch_when_grouped_gemm_not_requested(fake_te):
    assert isinstance(build(use_transformer_engine=False), gl.GroupedLinear)


@pytest.mark.parametrize("delay", [False, True])
def test_adapter_matches_the_torch_grouped_linear(fake_te, delay):
    torch.manual_seed(0)
    te_linear, torch_linear = build(delay=delay), gl.GroupedLinear(3, 16, 8, name="ref")
    for g in range(3):
        w = torch.randn(16, 8)
        te_linear.load_group_weight(g, w)
        torch_linear.load_group_weight(g, w)
    ready = []
    te_linear.register_grad_ready_hook(lambda p: ready.append(p))
    x, sizes, grad = torch.randn(9, 16), (4, 0, 5), torch.randn(9, 8)
    out = te_linear(x.requires_grad_(), sizes)
    assert torch.allclose(out, torch_linear(x, sizes))
    out.backward(grad)
    if delay:
        assert te_linear.pending_wgrads == 1 and not ready
        te_linear.backward_dw()
    assert te_linear.pending_wgrads == 0
    assert len(ready) == 3  # one grad-ready call per group weight
    torch_linear(x, sizes).backward(grad)
    for g, param in enumerate(te_linear.group_weights):
        assert torch.allclose(param.grad.t(), torch_linear.weight.grad[g])


def test_delay_is_fixed_at_construction(fake_te):
    linear = build(delay=True)
    linear.delay_wgrad = True
    with pytest.raises(ValueError, match="fixes delay_wgrad_compute=True when the module is built"):
        linear.delay_wgrad = False
