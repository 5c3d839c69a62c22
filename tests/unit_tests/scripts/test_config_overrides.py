"""The perf scripts' last pass over a recipe's config (``finalize_config_overrides``): the dispatcher a recipe asked
for is settled against what the model has, and NCCL user buffers against FSDP."""

from types import SimpleNamespace

import pytest
import torch
from utils.utils import finalize_config_overrides

from megatron.bridge.training.flex_dispatcher_backend import (
    apply_flex_dispatcher_backend,
    validate_flex_dispatcher_backend,
)
from tests.unit_tests.training.ep_overlap.test_flex_dispatcher_backend import moe_model


@pytest.mark.parametrize(
    "model, expected",
    [
        (moe_model(moe_flex_dispatcher_backend="hybridep"), ("flex", False)),
        (moe_model(moe_flex_dispatcher_backend="hybridep", num_moe_experts=None), ("alltoall", True)),
        (moe_model(moe_token_dispatcher_type="flex"), ("alltoall", True)),
    ],
)
def test_finalize_config_overrides_settles_the_dispatcher(model, expected):
    config = SimpleNamespace(model=model, ddp=SimpleNamespace())
    assert finalize_config_overrides(config) is config
    assert (model.moe_token_dispatcher_type, model.moe_shared_expert_overlap) == expected


@pytest.mark.parametrize(
    "ddp, expected",
    [
        (dict(nccl_ub=True, use_megatron_fsdp=True, fsdp_manual_registration=False), (False, True)),
        (dict(nccl_ub=True, use_megatron_fsdp=False, fsdp_manual_registration=False), (False, False)),
        (dict(nccl_ub=False, fsdp_manual_registration=True), (True, False)),
    ],
)
def test_finalize_config_overrides_settles_nccl_userbuffers(ddp, expected):
    config = SimpleNamespace(model=moe_model(), ddp=SimpleNamespace(average_in_collective=True, **ddp))
    finalize_config_overrides(config)
    assert (config.ddp.average_in_collective, config.ddp.fsdp_manual_registration) == expected


def test_unsupported_gpu_fallback_survives_override_finalization(monkeypatch):
    """A recipe that asked for DeepEP on a GB200 stays on alltoall after the perf scripts' last pass."""
    gb200 = SimpleNamespace(name="NVIDIA GB200", major=10)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: gb200)
    config = SimpleNamespace(model=moe_model(moe_flex_dispatcher_backend="deepep"), ddp=SimpleNamespace(nccl_ub=False))
    apply_flex_dispatcher_backend(config.model, "deepep")
    finalize_config_overrides(config)
    validate_flex_dispatcher_backend(config.model)
    assert (config.model.moe_token_dispatcher_type, config.model.moe_flex_dispatcher_backend) == ("alltoall", None)
