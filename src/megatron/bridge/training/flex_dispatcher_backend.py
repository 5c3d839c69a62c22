"""Activation and validation of Megatron-Core's flex token dispatcher (DeepEP / HybridEP backends).

Contract:
    * Setting ``moe_flex_dispatcher_backend`` alone does nothing: the dispatcher type must be "flex".
      :func:`apply_flex_dispatcher_backend` sets both (and turns ``moe_shared_expert_overlap`` off) when the
      GPU supports the backend; otherwise it warns once on rank 0 and leaves the model on "alltoall".
    * GPU gating: DeepEP needs compute capability major 8 or 9, or a device named "NVIDIA B200*"/"NVIDIA B300*";
      HybridEP needs major 8, 9 or 10 (B200/B300, GB200/GB300 NVL72).
    * No function here crashes on a host without CUDA: device properties are read only when CUDA is available,
      through :func:`device_properties`, which tests monkeypatch.
"""

import logging
from typing import Any, NamedTuple

import torch

from megatron.bridge.utils.config_values import is_explicitly_set
from megatron.bridge.utils.logging import warn_rank0

logger = logging.getLogger(__name__)

SUPPORTED_BACKENDS = ("deepep", "hybridep")


class FlexDispatcherConfigError(ValueError):
    """The model asks for the flex dispatcher with a backend this host or config cannot run."""


class DeviceProperties(NamedTuple):
    """What the gating reads of a GPU."""

    name: str
    major: int
    minor: int


def device_properties() -> DeviceProperties | None:
    """Properties of the current CUDA device, or None on a host without CUDA."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return DeviceProperties(props.name, props.major, props.minor)


def backend_unsupported_reason(backend: str, device: DeviceProperties | None) -> str | None:
    """Why ``backend`` cannot run on ``device``, or None when it can."""
    if backend not in SUPPORTED_BACKENDS:
        return f"unknown flex dispatcher backend {backend!r}; expected one of {SUPPORTED_BACKENDS}"
    if device is None:
        return f"{backend} needs a CUDA GPU and this host has none"
    if backend == "deepep":
        if device.major in (8, 9) or device.name.startswith(("NVIDIA B200", "NVIDIA B300")):
            return None
        return (
            f"DeepEP supports Ampere, Hopper, B200 and B300 GPUs, not {device.name} (sm_{device.major}{device.minor})"
        )
    if device.major in (8, 9, 10):
        return None
    return (
        f"HybridEP supports Ampere, Hopper and Blackwell (B200/B300, GB200/GB300 NVL72) GPUs, "
        f"not {device.name} (sm_{device.major}{device.minor})"
    )


def apply_flex_dispatcher_backend(model_config: Any, moe_flex_dispatcher_backend: str | None = None) -> bool:
    """Switches an MoE model to the flex dispatcher with the given backend, where this GPU supports it.

    Args:
        model_config: Model config (e.g. ``TransformerConfig``), modified in place.
        moe_flex_dispatcher_backend: "deepep" or "hybridep". None keeps the model's current
            ``moe_flex_dispatcher_backend``; when that is unset too, nothing is applied.

    Returns:
        True when flex is active afterwards; False when the model stays on the alltoall dispatcher.

    Raises:
        FlexDispatcherConfigError: For a backend name that is not "deepep" or "hybridep".
    """
    backend = moe_flex_dispatcher_backend or getattr(model_config, "moe_flex_dispatcher_backend", None)
    if backend is None:
        return False
    if backend not in SUPPORTED_BACKENDS:
        raise FlexDispatcherConfigError(
            f"moe_flex_dispatcher_backend={backend!r} is not supported; use one of {SUPPORTED_BACKENDS}."
        )
    if not (getattr(model_config, "num_moe_experts", None) or 0) > 0:
        warn_rank0(
            logger, "Flex dispatcher (%s) is for MoE models; num_moe_experts is unset, keeping alltoall.", backend
        )
        model_config.moe_token_dispatcher_type = "alltoall"
        return False
    reason = backend_unsupported_reason(backend, device_properties())
    if reason is not None:
        warn_rank0(logger, "Not enabling the flex dispatcher: %s. Falling back to the alltoall dispatcher.", reason)
        model_config.moe_token_dispatcher_type = "alltoall"
        return False
    model_config.moe_token_dispatcher_type = "flex"
    model_config.moe_flex_dispatcher_backend = backend
    # Flex backends run their own comm; overlapping shared experts separately would conflict with them.
    model_config.moe_shared_expert_overlap = False
    return True


def validate_flex_dispatcher_backend(model_config: Any) -> None:
    """Checks that a flex-dispatcher config can run on this host.

    A model with ``moe_token_dispatcher_type == "flex"`` must name a supported backend that this GPU runs.
    A backend set explicitly (different from the config's default) while the dispatcher type is not "flex"
    has no effect: that gets a rank-0 warning explaining how to activate it.

    Raises:
        FlexDispatcherConfigError: When flex is selected with an unknown backend or on an unsupported device.
    """
    dispatcher = getattr(model_config, "moe_token_dispatcher_type", None)
    backend = getattr(model_config, "moe_flex_dispatcher_backend", None)
    if dispatcher != "flex":
        if backend is not None and is_explicitly_set(model_config, "moe_flex_dispatcher_backend"):
            warn_rank0(
                logger,
                "moe_flex_dispatcher_backend=%r has no effect while moe_token_dispatcher_type=%r: the backend alone "
                "does not activate flex. Call apply_flex_dispatcher_backend(model_config, %r) to switch to it.",
                backend,
                dispatcher,
                backend,
            )
        return
    if backend is None:
        raise FlexDispatcherConfigError(
            "moe_token_dispatcher_type='flex' needs moe_flex_dispatcher_backend ('deepep' or 'hybridep'); "
            "use apply_flex_dispatcher_backend(model_config, 'deepep')."
        )
    reason = backend_unsupported_reason(backend, device_properties())
    if reason is not None:
        raise FlexDispatcherConfigError(
            f"moe_token_dispatcher_type='flex' with backend {backend!r} cannot run: {reason}. "
            "Use moe_token_dispatcher_type='alltoall', or apply_flex_dispatcher_backend() which falls back itself."
        )
