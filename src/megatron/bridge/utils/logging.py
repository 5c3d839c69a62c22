"""Rank-aware logging helpers."""

import logging

import torch.distributed as dist


def is_rank0() -> bool:
    """True on global rank 0, and in a process with no process group."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def warn_rank0(logger: logging.Logger, message: str, *args) -> None:
    """Logs a warning on rank 0 only, so N ranks do not print the same line N times."""
    if is_rank0():
        logger.warning(message, *args)
