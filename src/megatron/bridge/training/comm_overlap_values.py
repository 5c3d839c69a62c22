"""A ``CommOverlapConfig``'s own values (types, ranges), and values another config sets explicitly; every problem is
a ``Violation``. A module of its own because the plugin wheel ships without ``comm_overlap.py``."""

from collections.abc import Iterable
from typing import Any

from megatron.bridge.training.moe_overlap_rules import Violation
from megatron.bridge.utils.config_values import is_explicitly_set

_TP_BOOTSTRAP_BACKENDS = ("nccl", "mpi", "gloo")
# Fields where a value set explicitly on the model (or DDP/optimizer) config stands when comm_overlap's is None.
MODEL_RESOLVED_FIELDS = (
    "overlap_p2p_comm",
    "batch_p2p_comm",
    "defer_embedding_wgrad_compute",
    "wgrad_deferral_limit",
    "overlap_moe_expert_parallel_comm",
    "delay_wgrad_compute",
)
DP_RESOLVED_FIELDS = (
    "bucket_size",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "overlap_param_gather_with_optimizer_step",
    "align_param_gather",
)
_BOOL_FIELDS = (
    "tp_comm_overlap",
    "overlap_p2p_comm",
    "batch_p2p_comm",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "overlap_param_gather_with_optimizer_step",
    "align_param_gather",
    "defer_embedding_wgrad_compute",
    "overlap_moe_expert_parallel_comm",
    "delay_wgrad_compute",
)
_INT_FIELDS = ("bucket_size", "wgrad_deferral_limit", "data_parallel_size")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def comm_overlap_value_violations(cfg: Any) -> list[Violation]:
    """Fields of a ``CommOverlapConfig`` of the wrong type (a string for a bool) or out of range, all of them."""
    problems = []
    for name in _BOOL_FIELDS + _INT_FIELDS:
        value = getattr(cfg, name)
        expected = bool if name in _BOOL_FIELDS else int
        # bool is an int subclass: a True/False integer field is as wrong as a string for a bool field.
        if value is not None and (type(value) is not expected and not (expected is int and _is_int(value))):
            problems.append(
                Violation(
                    name,
                    {f"comm_overlap.{name}": value},
                    f"{name} must be {expected.__name__} or None, not {type(value).__name__}.",
                    f"set comm_overlap.{name} to {'True or False' if expected is bool else 'an integer'}"
                    " (None means auto).",
                )
            )
    if problems:
        return problems
    if cfg.data_parallel_size is not None and cfg.data_parallel_size < 1:
        problems.append(
            Violation(
                "data_parallel_size",
                {"comm_overlap.data_parallel_size": cfg.data_parallel_size},
                "data_parallel_size must be at least 1.",
                "leave it None (auto) or set a positive integer.",
            )
        )
    if cfg.bucket_size is not None and cfg.bucket_size <= 0:
        problems.append(
            Violation(
                "bucket_size",
                {"comm_overlap.bucket_size": cfg.bucket_size},
                "bucket_size must be positive.",
                "leave it None (auto: 128 Mi elements with DP > 1) or set a positive number of elements.",
            )
        )
    if cfg.tp_comm_bootstrap_backend is not None and cfg.tp_comm_bootstrap_backend not in _TP_BOOTSTRAP_BACKENDS:
        problems.append(
            Violation(
                "tp_comm_bootstrap_backend",
                {"comm_overlap.tp_comm_bootstrap_backend": cfg.tp_comm_bootstrap_backend},
                f"unknown TP bootstrap backend; expected one of {_TP_BOOTSTRAP_BACKENDS}.",
                "set tp_comm_bootstrap_backend to 'nccl', 'mpi' or 'gloo'.",
            )
        )
    if cfg.wgrad_deferral_limit is not None and cfg.wgrad_deferral_limit < -1:
        problems.append(
            Violation(
                "wgrad_deferral_limit",
                {"comm_overlap.wgrad_deferral_limit": cfg.wgrad_deferral_limit},
                "wgrad_deferral_limit must be -1 (no limit) or a non-negative number of microbatches.",
                "set wgrad_deferral_limit >= -1.",
            )
        )
    return problems


def explicit_values(user: Any, target: Any, names: Iterable[str]) -> tuple[dict[str, Any], list[Violation]]:
    """Values set explicitly on ``target``: (those the user left None, which stand; conflicts with the user's)."""
    kept: dict[str, Any] = {}
    problems: list[Violation] = []
    for name in names:
        if not is_explicitly_set(target, name):
            continue
        current, requested = getattr(target, name), getattr(user, name)
        if requested is None:
            kept[name] = current
        elif current != requested:
            problems.append(conflict(target, name, current, requested))
    return kept, problems


def conflict(target: Any, name: str, target_value: Any, user_value: Any) -> Violation:
    """A value set explicitly on ``target`` (a model, DDP or optimizer config) that comm_overlap contradicts."""
    where = type(target).__name__
    return Violation(
        "conflict",
        {f"{where}.{name}": target_value, f"comm_overlap.{name}": user_value},
        f"the {where} sets {name}={target_value!r} but comm_overlap sets {user_value!r}; neither wins silently.",
        f"set it in one place: leave comm_overlap.{name}=None to keep the {where} value, or make both {user_value!r}.",
    )
