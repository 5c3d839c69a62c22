"""The entry point for EP overlap on a stock Megatron-Bridge: a ``CommOverlapConfig`` that checks everything first.

Contract:
    * :class:`EPOverlapCommOverlapConfig` is a ``megatron.bridge.training.comm_overlap.CommOverlapConfig``:
      upstream's when this project is installed as a plugin beside Megatron-Bridge, this project's superset when
      it runs standalone or is applied as a patch. A recipe swaps the class and nothing else.
    * ``finalize()`` refuses fields of the wrong type or range, all in one :class:`CommOverlapConfigError`, then
      runs the base's ``finalize``.
    * ``setup(model_config, optimizer_config, ddp_config)`` checks before anything is written: the field values,
      every EP-overlap rule of ``moe_overlap_rules`` (one error listing every violation with its fix), and that no
      value set explicitly on the model, DDP or optimizer config is contradicted. Then it keeps those explicit
      values (upstream's base would overwrite them with auto values), runs the base's ``setup`` for TP, PP and DP
      overlap with the two MoE flags held back (the rules above decide them, not upstream's first failed
      assert), and writes the resolved MoE flags to the model config.
    * Where the base already does all of this (this project's own ``CommOverlapConfig``, which says so with
      ``checks_ep_overlap_rules``), ``setup`` is the base's.
"""

from dataclasses import dataclass
from typing import Any

from megatron.bridge.training.comm_overlap import CommOverlapConfig
from megatron.bridge.training.comm_overlap_values import (
    DP_RESOLVED_FIELDS,
    MODEL_RESOLVED_FIELDS,
    comm_overlap_value_violations,
    explicit_values,
)
from megatron.bridge.training.ep_overlap.options import EPOverlapOptions
from megatron.bridge.training.ep_overlap.settings import defer_overlap_flag, delayed_wgrad_to_ddp, resolve
from megatron.bridge.training.moe_overlap_rules import (
    CommOverlapConfigError,
    Violation,
    defers_mcore_checks,
)
from megatron.bridge.utils.process_groups import data_parallel_size_of

MOE_FLAGS = ("overlap_moe_expert_parallel_comm", "delay_wgrad_compute")


@dataclass(kw_only=True)
class EPOverlapCommOverlapConfig(CommOverlapConfig):
    """``CommOverlapConfig`` with this project's EP-overlap rules and single error, on any Megatron-Bridge."""

    def finalize(self) -> None:
        problems = comm_overlap_value_violations(self)
        if problems:
            raise CommOverlapConfigError(problems)
        super().finalize()

    def setup(self, model_config: Any, optimizer_config: Any = None, ddp_config: Any = None) -> None:
        if getattr(CommOverlapConfig, "checks_ep_overlap_rules", False):
            super().setup(model_config, optimizer_config, ddp_config)
            return
        if getattr(self, "user_comm_overlap_cfg", None) is None:
            self.finalize()
        if self.data_parallel_size is None:
            self.data_parallel_size = data_parallel_size_of(model_config)
        user = self.user_comm_overlap_cfg
        distributed = optimizer_config is not None and bool(getattr(ddp_config, "use_distributed_optimizer", False))
        targets = [(model_config, MODEL_RESOLVED_FIELDS)]
        if distributed:
            targets += [(optimizer_config, DP_RESOLVED_FIELDS), (ddp_config, DP_RESOLVED_FIELDS)]
        problems: list[Violation] = []
        kept: dict[str, Any] = {}
        for target, names in targets:
            target_kept, conflicts = explicit_values(user, target, names)
            problems += conflicts
            kept = target_kept | kept  # the first target that sets a field wins: model, then optimizer, then DDP
        overlap, delay = (bool(_first(getattr(user, flag), kept.get(flag), False)) for flag in MOE_FLAGS)
        grad_reduce = _first(
            user.overlap_grad_reduce,
            kept.get("overlap_grad_reduce"),
            distributed and self.data_parallel_size > 1,
        )
        problems += resolve(
            model_config,
            EPOverlapOptions(overlap=overlap, delay_wgrad=delay),
            overlap_grad_reduce=bool(grad_reduce),
            # a Bridge model provider runs Megatron-Core's own checks after this setup
            model_config_built=not defers_mcore_checks(model_config),
            megatron_fsdp=bool(getattr(ddp_config, "use_megatron_fsdp", False)),
        ).violations
        if problems:
            raise CommOverlapConfigError(problems)
        requested = {flag: getattr(user, flag) for flag in MOE_FLAGS}
        for name, value in kept.items():
            setattr(user, name, value)
        for flag in MOE_FLAGS:
            setattr(user, flag, None)  # held back from the base's own asserts
        try:
            super().setup(model_config, optimizer_config, ddp_config)
        finally:
            for flag, value in requested.items():
                setattr(user, flag, value)
        model_config.overlap_moe_expert_parallel_comm = overlap
        model_config.delay_wgrad_compute = delay
        delayed_wgrad_to_ddp(model_config, ddp_config)
        defer_overlap_flag(model_config)


def _first(*values: Any) -> Any:
    """The first value that is not None."""
    return next(value for value in values if value is not None)
