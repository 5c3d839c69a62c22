"""Megatron-Core's flex token dispatcher (DeepEP, HybridEP, NCCL EP), upstream's surface kept: ``apply`` switches to
it where the GPU supports the backend (:data:`BACKENDS`), else warns once and falls back to "alltoall"; ``validate``
raises :class:`FlexDispatcherConfigError` naming the fix (unknown backend, no GPU, unsupported GPU)."""

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from megatron.bridge.utils.config_values import is_explicitly_set
from megatron.bridge.utils.logging import warn_rank0

logger: logging.Logger = logging.getLogger(__name__)


class BackendSupport(NamedTuple):
    """Which GPUs run a flex backend."""

    label: str
    gpus: str
    supports: Callable[[Any], bool]


BACKENDS: dict[str, BackendSupport] = {
    "deepep": BackendSupport(
        "DeepEP",
        "Ampere, Hopper, and Blackwell (B200/B300) GPUs",
        lambda device: device.major in (8, 9) or device.name.startswith(("NVIDIA B200", "NVIDIA B300")),
    ),
    "hybridep": BackendSupport(
        "HybridEP",
        "GB200, GB300 with NVL72 and for Ampere, Hopper, B200 and B300 GPUs",
        lambda device: device.major in (8, 9, 10),
    ),
    "ncclep": BackendSupport("NCCL EP", "Hopper and Blackwell GPUs", lambda device: device.major in (9, 10)),
}
SUPPORTED_BACKENDS = tuple(BACKENDS)


class FlexDispatcherConfigError(ValueError):
    """The model asks for the flex dispatcher with a backend this host or config cannot run."""


def _fallback_to_alltoall(model_config: Any) -> None:
    """Leaves the flex dispatcher: alltoall, and no backend that a later pass could re-activate."""
    model_config.moe_token_dispatcher_type = "alltoall"
    model_config.moe_flex_dispatcher_backend = None


def _activate(model_config: Any, backend: str) -> None:
    model_config.moe_token_dispatcher_type = "flex"
    model_config.moe_flex_dispatcher_backend = backend
    # Flex backends run their own comm; overlapping shared experts separately would conflict with them.
    model_config.moe_shared_expert_overlap = False


def apply_flex_dispatcher_backend(model_config: Any, moe_flex_dispatcher_backend: str | None = None) -> None:
    """Switches an MoE model to the flex dispatcher with the given backend, where this GPU supports it.

    Args:
        model_config: Model config (e.g. ``TransformerConfig``), modified in place.
        moe_flex_dispatcher_backend: "deepep", "hybridep" or "ncclep". Anything else is warned about and
            changes nothing.
    """
    num_moe_experts = getattr(model_config, "num_moe_experts", None)
    if not num_moe_experts:
        warn_rank0(
            logger,
            "DeepEP and HybridEP are only applicable to MoE models; num_moe_experts is not set or is 0 on this "
            "model config. Skipping the flex dispatcher configuration.",
        )
        return
    support = BACKENDS.get(moe_flex_dispatcher_backend)
    if support is None:
        warn_rank0(
            logger,
            f"Not a valid flex dispatcher backend: {moe_flex_dispatcher_backend!r}. Expected one of "
            f"{', '.join(SUPPORTED_BACKENDS)}. Skipping flex dispatcher backend configuration.",
        )
        return
    if not torch.cuda.is_available():
        _activate(model_config, moe_flex_dispatcher_backend)
        return
    device = torch.cuda.get_device_properties(0)
    if not support.supports(device):
        warn_rank0(
            logger,
            f"{support.label} is only applicable to {support.gpus}. Current GPU: {device.name}. "
            "Falling back to alltoall.",
        )
        _fallback_to_alltoall(model_config)
        return
    _activate(model_config, moe_flex_dispatcher_backend)


def validate_flex_dispatcher_backend(model_config: Any) -> None:
    """Checks that a flex-dispatcher config can run on this host.

    Raises:
        FlexDispatcherConfigError: (a ``ValueError``) when flex is selected with an unknown backend, on a host
            without CUDA, or on a GPU the backend does not support.
    """
    dispatcher = getattr(model_config, "moe_token_dispatcher_type", None)
    backend = getattr(model_config, "moe_flex_dispatcher_backend", None)
    if dispatcher != "flex":
        if backend is not None and is_explicitly_set(model_config, "moe_flex_dispatcher_backend"):
            warn_rank0(
                logger,
                f"moe_flex_dispatcher_backend={backend!r} has no effect while moe_token_dispatcher_type="
                f"{dispatcher!r}: the backend alone does not activate flex. Call "
                f"apply_flex_dispatcher_backend(model_config, {backend!r}) to switch to it.",
            )
        return
    if backend is None:
        _fallback_to_alltoall(model_config)
        return
    fix = "Use moe_token_dispatcher_type='alltoall', or apply_flex_dispatcher_backend(), which falls back itself."
    support = BACKENDS.get(backend)
    if support is None:
        raise FlexDispatcherConfigError(
            f"moe_flex_dispatcher_backend={backend!r} is not supported; expected one of {SUPPORTED_BACKENDS}. {fix}"
        )
    try:  # as upstream asks, so a mocked or real device answers first
        device = torch.cuda.get_device_properties(0)
    except (RuntimeError, AssertionError):  # no driver, or a torch built without CUDA
        if torch.cuda.is_available():
            raise
        raise FlexDispatcherConfigError(
            f"moe_token_dispatcher_type='flex' with {support.label} needs a CUDA GPU and this host has none. {fix}"
        ) from None
    if not support.supports(device):
        raise FlexDispatcherConfigError(
            f"{support.label} is supported for {support.gpus}. Current GPU: {device.name}. {fix}"
        )
