"""Flex dispatcher activation: GPU gating per generation, CPU-host safety, and the inactive-backend warning."""

import logging
from types import SimpleNamespace

import pytest
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.bridge.training import flex_dispatcher_backend as flex
from megatron.bridge.training.flex_dispatcher_backend import (
    DeviceProperties,
    FlexDispatcherConfigError,
    apply_flex_dispatcher_backend,
    validate_flex_dispatcher_backend,
)

A100 = DeviceProperties("NVIDIA A100-SXM4-80GB", 8, 0)
H100 = DeviceProperties("NVIDIA H100 80GB HBM3", 9, 0)
B200 = DeviceProperties("NVIDIA B200", 10, 0)
GB200 = DeviceProperties("NVIDIA GB200", 10, 0)
RTX5090 = DeviceProperties("NVIDIA GeForce RTX 5090", 12, 0)
V100 = DeviceProperties("Tesla V100-SXM2-32GB", 7, 0)


def moe_model(**overrides):
    settings = dict(
        num_moe_experts=8,
        moe_token_dispatcher_type="alltoall",
        moe_flex_dispatcher_backend=None,
        moe_shared_expert_overlap=True,
    )
    settings.update(overrides)
    return SimpleNamespace(**settings)


@pytest.mark.parametrize(
    "device, backend, active",
    [
        (A100, "deepep", True),
        (H100, "deepep", True),
        (B200, "deepep", True),
        (GB200, "deepep", False),
        (RTX5090, "deepep", False),
        (V100, "deepep", False),
        (A100, "hybridep", True),
        (H100, "hybridep", True),
        (B200, "hybridep", True),
        (GB200, "hybridep", True),
        (RTX5090, "hybridep", False),
        (V100, "hybridep", False),
        (None, "deepep", False),
        (None, "hybridep", False),
    ],
)
def test_gating_per_gpu_generation(monkeypatch, caplog, device, backend, active):
    monkeypatch.setattr(flex, "device_properties", lambda: device)
    model = moe_model()
    with caplog.at_level(logging.WARNING):
        assert apply_flex_dispatcher_backend(model, backend) is active
    if active:
        assert model.moe_token_dispatcher_type == "flex"
        assert model.moe_flex_dispatcher_backend == backend
        assert model.moe_shared_expert_overlap is False
    else:
        assert model.moe_token_dispatcher_type == "alltoall"
        assert "Falling back to the alltoall dispatcher" in caplog.text


def test_real_host_never_crashes():
    # On a CPU-only host this must fall back, not raise from torch.cuda.
    model = moe_model()
    active = apply_flex_dispatcher_backend(model, "deepep")
    assert model.moe_token_dispatcher_type == ("flex" if active else "alltoall")


def test_backend_none_uses_model_value(monkeypatch):
    monkeypatch.setattr(flex, "device_properties", lambda: H100)
    model = moe_model(moe_flex_dispatcher_backend="hybridep")
    assert apply_flex_dispatcher_backend(model) is True
    assert model.moe_flex_dispatcher_backend == "hybridep"


def test_backend_none_everywhere_applies_nothing(monkeypatch):
    monkeypatch.setattr(flex, "device_properties", lambda: H100)
    model = moe_model()
    assert apply_flex_dispatcher_backend(model) is False
    assert model.moe_token_dispatcher_type == "alltoall"


def test_non_moe_model_warns_and_keeps_alltoall(monkeypatch, caplog):
    monkeypatch.setattr(flex, "device_properties", lambda: H100)
    model = moe_model(num_moe_experts=None)
    with caplog.at_level(logging.WARNING):
        assert apply_flex_dispatcher_backend(model, "deepep") is False
    assert model.moe_token_dispatcher_type == "alltoall"
    assert "for MoE models" in caplog.text


def test_unknown_backend_is_an_error():
    with pytest.raises(FlexDispatcherConfigError, match="'nvshmem' is not supported"):
        apply_flex_dispatcher_backend(moe_model(), "nvshmem")


def test_validate_flex_on_unsupported_gpu_raises(monkeypatch):
    monkeypatch.setattr(flex, "device_properties", lambda: V100)
    with pytest.raises(FlexDispatcherConfigError, match="DeepEP supports Ampere, Hopper, B200 and B300"):
        validate_flex_dispatcher_backend(
            moe_model(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep")
        )


def test_validate_flex_on_cpu_host_raises(monkeypatch):
    monkeypatch.setattr(flex, "device_properties", lambda: None)
    with pytest.raises(FlexDispatcherConfigError, match="needs a CUDA GPU"):
        validate_flex_dispatcher_backend(
            moe_model(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep")
        )


def test_validate_flex_on_supported_gpu_passes(monkeypatch):
    monkeypatch.setattr(flex, "device_properties", lambda: GB200)
    validate_flex_dispatcher_backend(
        moe_model(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep")
    )


def test_validate_explains_backend_alone_does_not_activate_flex(caplog):
    model = moe_model(moe_flex_dispatcher_backend="hybridep")
    with caplog.at_level(logging.WARNING):
        validate_flex_dispatcher_backend(model)
    assert "the backend alone does not activate flex" in caplog.text
    assert "apply_flex_dispatcher_backend(model_config, 'hybridep')" in caplog.text


def test_validate_is_quiet_about_the_class_default_backend(caplog):
    # TransformerConfig defaults moe_flex_dispatcher_backend to "deepep"; that default is not a user request.
    model = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=2)
    with caplog.at_level(logging.WARNING):
        validate_flex_dispatcher_backend(model)
    assert caplog.text == ""
