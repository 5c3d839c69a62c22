"""Flex dispatcher activation: GPU gating, CPU-host safety, fallbacks, and the inactive-backend warning."""

import logging
from types import SimpleNamespace

import pytest
import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.bridge.training.flex_dispatcher_backend import (
    FlexDispatcherConfigError,
    apply_flex_dispatcher_backend,
    validate_flex_dispatcher_backend,
)

A100 = SimpleNamespace(name="NVIDIA A100-SXM4-80GB", major=8)
H100 = SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9)
B200 = SimpleNamespace(name="NVIDIA B200", major=10)
GB200 = SimpleNamespace(name="NVIDIA GB200", major=10)
RTX5090 = SimpleNamespace(name="NVIDIA GeForce RTX 5090", major=12)
V100 = SimpleNamespace(name="Tesla V100-SXM2-32GB", major=7)


@pytest.fixture
def gpu(monkeypatch):
    """gpu(device) makes this host look like one with that GPU (None: no CUDA); returns the probe calls."""
    calls = []

    def pretend(device):
        def properties(index):
            calls.append(index)
            if device is None:  # what torch does on a host without a driver
                raise RuntimeError("Found no NVIDIA driver on your system.")
            return device

        monkeypatch.setattr(torch.cuda, "is_available", lambda: device is not None)
        monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
        return calls

    return pretend


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
        (A100, "ncclep", False),
        (H100, "ncclep", True),
        (GB200, "ncclep", True),
        (RTX5090, "ncclep", False),
    ],
)
def test_gating_per_gpu_generation(gpu, caplog, device, backend, active):
    calls = gpu(device)
    model = moe_model()
    with caplog.at_level(logging.WARNING):
        apply_flex_dispatcher_backend(model, backend)
    assert calls == [0]
    if active:
        assert (model.moe_token_dispatcher_type, model.moe_flex_dispatcher_backend) == ("flex", backend)
        assert model.moe_shared_expert_overlap is False
    else:
        # The fallback clears the backend, so nothing downstream can switch flex back on.
        assert (model.moe_token_dispatcher_type, model.moe_flex_dispatcher_backend) == ("alltoall", None)
        assert model.moe_shared_expert_overlap is True
        assert f"Current GPU: {device.name}. Falling back to alltoall." in caplog.text


@pytest.mark.parametrize("backend", ["deepep", "hybridep", "ncclep"])
def test_cpu_host_records_backend_without_touching_cuda(gpu, backend):
    calls = gpu(None)
    model = moe_model()
    apply_flex_dispatcher_backend(model, backend)
    assert calls == []
    assert (model.moe_token_dispatcher_type, model.moe_flex_dispatcher_backend) == ("flex", backend)


@pytest.mark.parametrize("backend", [None, "nvshmem"])
def test_invalid_backend_warns_and_changes_nothing_even_on_a_cpu_host(gpu, caplog, backend):
    calls = gpu(None)
    model = moe_model()
    with caplog.at_level(logging.WARNING):
        apply_flex_dispatcher_backend(model, backend)
    assert calls == []
    assert model == moe_model()
    assert "Not a valid flex dispatcher backend" in caplog.text


@pytest.mark.parametrize("experts", [None, 0])
def test_non_moe_model_warns_and_leaves_the_dispatcher_alone(gpu, caplog, experts):
    gpu(H100)
    model = moe_model(num_moe_experts=experts, moe_token_dispatcher_type="allgather")
    with caplog.at_level(logging.WARNING):
        apply_flex_dispatcher_backend(model, "deepep")
    assert model.moe_token_dispatcher_type == "allgather"
    assert "only applicable to MoE models" in caplog.text


def test_cleared_backend_restores_alltoall(gpu):
    gpu(H100)
    model = moe_model()
    apply_flex_dispatcher_backend(model, "deepep")
    model.moe_flex_dispatcher_backend = None
    validate_flex_dispatcher_backend(model)
    assert model.moe_token_dispatcher_type == "alltoall"


def test_validate_flex_on_unsupported_gpu_raises(gpu):
    gpu(V100)
    with pytest.raises(FlexDispatcherConfigError, match=r"DeepEP is supported for Ampere, Hopper, and Blackwell"):
        validate_flex_dispatcher_backend(
            moe_model(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep")
        )


def test_validate_flex_on_cpu_host_raises_a_clear_error(gpu):
    calls = gpu(None)
    with pytest.raises(FlexDispatcherConfigError, match="needs a CUDA GPU and this host has none") as raised:
        validate_flex_dispatcher_backend(
            moe_model(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep")
        )
    assert calls == [0]  # asked as upstream asks; the call could not answer
    assert raised.value.__cause__ is None and "NVIDIA driver" not in str(raised.value)


@pytest.mark.parametrize("device, error", [(A100, None), (B200, None), (V100, "DeepEP is supported for Ampere")])
def test_validate_asks_the_device_first_so_a_mocked_gpu_answers_on_a_cpu_host(monkeypatch, device, error):
    # Upstream's test_config.py mocks get_device_properties alone; is_available stays this host's (False here).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: device)
    model = moe_model(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep")
    if error is None:
        validate_flex_dispatcher_backend(model)
        assert model.moe_token_dispatcher_type == "flex"
    else:
        with pytest.raises(ValueError, match=error):
            validate_flex_dispatcher_backend(model)


def test_validate_flex_with_unknown_backend_raises(gpu):
    gpu(H100)
    with pytest.raises(FlexDispatcherConfigError, match="'nvshmem' is not supported"):
        validate_flex_dispatcher_backend(
            moe_model(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="nvshmem")
        )


def test_validate_flex_on_supported_gpu_passes(gpu):
    gpu(GB200)
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
