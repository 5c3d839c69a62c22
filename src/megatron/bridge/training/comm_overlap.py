"""Communication-overlap settings for Megatron-Bridge training: TP, PP, DP and MoE expert-parallel overlap.

Contract:
    * ``CommOverlapConfig`` fields are user intent; ``None`` means "auto" (resolve from the parallel layout).
    * ``setup(model_config, optimizer_config, ddp_config)`` resolves every field, checks everything, and only
      then writes the resolved values into the configs. It raises one :class:`CommOverlapConfigError` that
      lists every problem, and on error writes nothing.
    * A value the user set on the model (or DDP/optimizer) config is never silently discarded: when this
      config leaves a field ``None`` the explicit value stands; when both are set and disagree, that is an
      error. "Set" means different from the config class's dataclass default. For objects that are not
      dataclasses every present attribute counts as set.
    * :func:`comm_overlap_violations` returns the same problems as a list, without raising or writing.
"""

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron.bridge.training.moe_overlap_rules import (
    CommOverlapConfigError,
    Violation,
    check_moe_overlap,
)
from megatron.bridge.utils import versions
from megatron.bridge.utils.config_values import is_explicitly_set
from megatron.bridge.utils.logging import warn_rank0

__all__ = ["CommOverlapConfig", "CommOverlapConfigError", "Violation", "comm_overlap_violations"]

logger = logging.getLogger(__name__)

_DP_BUCKET_SIZE = 128 * 1024 * 1024
_TP_BOOTSTRAP_BACKENDS = ("nccl", "mpi", "gloo")


@dataclass(kw_only=True)
class CommOverlapConfig:
    """Which communications to overlap with compute. ``None`` means "auto".

    Attributes:
        tp_comm_overlap: Tensor-parallel comm overlap (Transformer Engine userbuffers). Required.
        tp_comm_overlap_cfg: Per-GEMM TP overlap settings (an object or dict), used when TP overlap is on.
        tp_comm_bootstrap_backend: Backend used to bootstrap TP userbuffers: "nccl", "mpi" or "gloo".
        overlap_p2p_comm: Overlap pipeline send/recv with compute (auto: on with PP > 1 and VPP).
        batch_p2p_comm: Batch pipeline send/recv (auto: on with PP > 1 without VPP).
        overlap_grad_reduce: Overlap DP gradient reduce-scatter (auto: on with DP > 1 and distributed optimizer).
        overlap_param_gather: Overlap DP parameter all-gather (auto: as overlap_grad_reduce).
        overlap_param_gather_with_optimizer_step: Overlap param all-gather with the optimizer step.
        align_param_gather: Align param all-gathers across virtual stages (auto: on with PP > 1 and VPP).
        bucket_size: DP bucket size in elements (auto: 128 Mi with DP > 1 and distributed optimizer).
        defer_embedding_wgrad_compute: Defer the embedding wgrad into the pipeline bubble.
        wgrad_deferral_limit: Number of microbatches the embedding wgrad may be deferred (-1: no limit).
        overlap_moe_expert_parallel_comm: Hide MoE expert-parallel all-to-all behind the other microbatch's
            compute (1F1B-interleaved layer schedule). Auto keeps the model config's value.
        delay_wgrad_compute: Compute expert weight gradients under the dispatch-backward all-to-all.
            Needs overlap_moe_expert_parallel_comm. Auto keeps the model config's value.
        data_parallel_size: DP size (auto: world size / (TP * PP * CP) when a process group exists, else 1).
    """

    tp_comm_overlap: bool
    tp_comm_overlap_cfg: Any | None = None
    tp_comm_bootstrap_backend: str | None = None
    overlap_p2p_comm: bool | None = None
    batch_p2p_comm: bool | None = None
    overlap_grad_reduce: bool | None = None
    overlap_param_gather: bool | None = None
    overlap_param_gather_with_optimizer_step: bool | None = None
    align_param_gather: bool | None = None
    bucket_size: int | None = None
    defer_embedding_wgrad_compute: bool | None = None
    wgrad_deferral_limit: int | None = None
    overlap_moe_expert_parallel_comm: bool | None = None
    delay_wgrad_compute: bool | None = None
    data_parallel_size: int | None = None

    def finalize(self) -> None:
        """Checks this config's own values (not the model's). Raises CommOverlapConfigError listing all."""
        problems = self._own_violations()
        if problems:
            raise CommOverlapConfigError(problems)

    def setup(self, model_config: Any, optimizer_config: Any = None, ddp_config: Any = None) -> None:
        """Resolves every field, validates, then writes the values into the given configs.

        Args:
            model_config: The model config (e.g. a Megatron-Core ``TransformerConfig`` or a Bridge provider).
            optimizer_config: Optional optimizer config; receives DP overlap values with a distributed optimizer.
            ddp_config: Optional DDP config; receives DP overlap values with a distributed optimizer.

        Raises:
            CommOverlapConfigError: One error listing every violated rule and every model/overlap conflict.
        """
        plan, problems = self._resolve(model_config, optimizer_config, ddp_config)
        if problems:
            raise CommOverlapConfigError(problems)
        for target, values in plan:
            for name, value in values.items():
                setattr(target, name, value)
        if getattr(model_config, "tp_comm_overlap", False) and self.tp_comm_overlap_cfg is not None:
            cfg = self.tp_comm_overlap_cfg
            model_config.tp_comm_overlap_cfg = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else cfg
            model_config.tp_comm_bootstrap_backend = self.tp_comm_bootstrap_backend
        self._set_cuda_device_max_connections(model_config)

    # ----------------------------------------------------------------------------------------------------
    # resolution

    def _resolve(
        self, model_config: Any, optimizer_config: Any, ddp_config: Any
    ) -> tuple[list[tuple[Any, dict[str, Any]]], list[Violation]]:
        """Returns (what to write where, every problem found); writes nothing."""
        problems = self._own_violations()
        plan: list[tuple[Any, dict[str, Any]]] = []

        model_values = self._merge_into(model_config, self._model_auto_values(model_config), problems)
        # The user always states tp_comm_overlap; it is turned off (with a warning) where it cannot work.
        model_values["tp_comm_overlap"] = model_values["tp_comm_overlap"] and self._tp_overlap_feasible(model_config)
        plan.append((model_config, model_values))

        overlap_grad_reduce = bool(getattr(ddp_config, "overlap_grad_reduce", False))
        if (
            ddp_config is not None
            and optimizer_config is not None
            and getattr(ddp_config, "use_distributed_optimizer", False)
        ):
            dp_auto = self._dp_auto_values(model_config)
            for target in (optimizer_config, ddp_config):
                applicable = {name: value for name, value in dp_auto.items() if hasattr(target, name)}
                values = self._merge_into(target, applicable, problems)
                plan.append((target, values))
                overlap_grad_reduce = values.get("overlap_grad_reduce", overlap_grad_reduce)

        problems += check_moe_overlap(
            model_config,
            overlap_moe_expert_parallel_comm=model_values["overlap_moe_expert_parallel_comm"],
            delay_wgrad_compute=model_values["delay_wgrad_compute"],
            overlap_grad_reduce=overlap_grad_reduce,
        )
        return plan, problems

    def _model_auto_values(self, model_config: Any) -> dict[str, Any]:
        """Auto values for the fields written into the model config (before user/model precedence)."""
        pp = getattr(model_config, "pipeline_model_parallel_size", 1) or 1
        vpp = getattr(model_config, "virtual_pipeline_model_parallel_size", None) or 1
        return {
            "tp_comm_overlap": False,
            "overlap_p2p_comm": pp > 1 and vpp > 1,
            "batch_p2p_comm": pp > 1 and vpp == 1,
            "defer_embedding_wgrad_compute": False,
            "wgrad_deferral_limit": -1,
            "overlap_moe_expert_parallel_comm": False,
            "delay_wgrad_compute": False,
        }

    def _tp_overlap_feasible(self, model_config: Any) -> bool:
        """False, with a rank-0 warning, where TP overlap cannot work."""
        reason = None
        if (getattr(model_config, "tensor_model_parallel_size", 1) or 1) < 2:
            reason = "tensor_model_parallel_size < 2"
        elif not getattr(model_config, "sequence_parallel", False):
            reason = "sequence_parallel=False"
        elif versions.te_version() is None:
            reason = "Transformer Engine is not installed"
        if reason is not None:
            warn_rank0(logger, "Disabling tensor-parallel communication overlap: %s.", reason)
            return False
        return True

    def _dp_auto_values(self, model_config: Any) -> dict[str, Any]:
        """Auto values for data-parallel overlap (distributed optimizer only)."""
        dp = self.data_parallel_size or _infer_data_parallel_size(model_config)
        pp = getattr(model_config, "pipeline_model_parallel_size", 1) or 1
        vpp = getattr(model_config, "virtual_pipeline_model_parallel_size", None) or 1
        return {
            "bucket_size": _DP_BUCKET_SIZE if dp > 1 else None,
            "overlap_grad_reduce": dp > 1,
            "overlap_param_gather": dp > 1,
            "overlap_param_gather_with_optimizer_step": False,
            "align_param_gather": dp > 1 and pp > 1 and vpp > 1,
        }

    def _merge_into(self, target: Any, auto: dict[str, Any], problems: list[Violation]) -> dict[str, Any]:
        """Applies precedence user > explicit target value > auto; records user/target disagreements."""
        resolved = {}
        for name, auto_value in auto.items():
            user = getattr(self, name)
            current = getattr(target, name, None)
            explicit = is_explicitly_set(target, name)
            if user is not None:
                if explicit and current != user:
                    problems.append(_conflict(target, name, current, user))
                resolved[name] = user
            elif explicit:
                resolved[name] = current
            else:
                resolved[name] = auto_value
        return resolved

    def _own_violations(self) -> list[Violation]:
        problems = []
        if self.data_parallel_size is not None and self.data_parallel_size < 1:
            problems.append(
                Violation(
                    "data_parallel_size",
                    {"comm_overlap.data_parallel_size": self.data_parallel_size},
                    "data_parallel_size must be at least 1.",
                    "leave it None (auto) or set a positive integer.",
                )
            )
        if self.bucket_size is not None and self.bucket_size <= 0:
            problems.append(
                Violation(
                    "bucket_size",
                    {"comm_overlap.bucket_size": self.bucket_size},
                    "bucket_size must be positive.",
                    "leave it None (auto: 128 Mi elements with DP > 1) or set a positive number of elements.",
                )
            )
        if self.tp_comm_bootstrap_backend is not None and self.tp_comm_bootstrap_backend not in _TP_BOOTSTRAP_BACKENDS:
            problems.append(
                Violation(
                    "tp_comm_bootstrap_backend",
                    {"comm_overlap.tp_comm_bootstrap_backend": self.tp_comm_bootstrap_backend},
                    f"unknown TP bootstrap backend; expected one of {_TP_BOOTSTRAP_BACKENDS}.",
                    "set tp_comm_bootstrap_backend to 'nccl', 'mpi' or 'gloo', or leave it None.",
                )
            )
        if self.wgrad_deferral_limit is not None and self.wgrad_deferral_limit < -1:
            problems.append(
                Violation(
                    "wgrad_deferral_limit",
                    {"comm_overlap.wgrad_deferral_limit": self.wgrad_deferral_limit},
                    "wgrad_deferral_limit must be -1 (no limit) or a non-negative number of microbatches.",
                    "set wgrad_deferral_limit >= -1.",
                )
            )
        return problems

    def _set_cuda_device_max_connections(self, model_config: Any) -> None:
        """Sets CUDA_DEVICE_MAX_CONNECTIONS as the overlap settings need it. No-op without CUDA."""
        if not torch.cuda.is_available():
            return
        tp = getattr(model_config, "tensor_model_parallel_size", 1) or 1
        cp = getattr(model_config, "context_parallel_size", 1) or 1
        if getattr(model_config, "overlap_moe_expert_parallel_comm", False):
            # The comm stream needs its own hardware queue, or the all-to-all waits behind compute kernels.
            if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
                warn_rank0(
                    logger,
                    "CUDA_DEVICE_MAX_CONNECTIONS=1 serializes the comm and compute streams and shrinks EP "
                    "overlap; unset it or set 32.",
                )
            return
        major, _ = torch.cuda.get_device_capability()
        if major <= 9 and (tp > 1 or cp > 1):
            # Keep host issue order on the GPU, so TP comm kernels start before the GEMM they overlap.
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
            logger.info("Set CUDA_DEVICE_MAX_CONNECTIONS=1")


def comm_overlap_violations(
    comm_overlap: CommOverlapConfig, model_config: Any, optimizer_config: Any = None, ddp_config: Any = None
) -> list[Violation]:
    """Every problem ``comm_overlap.setup`` would raise for these configs, as a list. Never raises or writes."""
    _, problems = comm_overlap._resolve(model_config, optimizer_config, ddp_config)
    return problems


def _conflict(target: Any, name: str, target_value: Any, user_value: Any) -> Violation:
    where = type(target).__name__
    return Violation(
        "conflict",
        {f"{where}.{name}": target_value, f"comm_overlap.{name}": user_value},
        f"the {where} sets {name}={target_value!r} but comm_overlap sets {user_value!r}; neither wins silently.",
        f"set it in one place: leave comm_overlap.{name}=None to keep the {where} value, or make both {user_value!r}.",
    )


def _infer_data_parallel_size(model_config: Any) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    model_parallel = 1
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        model_parallel *= getattr(model_config, name, 1) or 1
    return max(1, dist.get_world_size() // model_parallel)
