"""The expert-parallel ranks agree on each step's microbatch count before the step's first all-to-all.

Different counts would hang until the collective timeout; :class:`Agreement` fails every rank at once instead. A count
known at the step's start costs one host all-gather per step; otherwise every driver call is agreed.
"""

import contextlib
import contextvars

import torch

FORWARD, PAIRED, BACKWARD = "forward", "paired", "backward"
_KINDS = (FORWARD, PAIRED, BACKWARD)
_ANNOUNCED: contextvars.ContextVar[int | None] = contextvars.ContextVar("ep_overlap_microbatches", default=None)


@contextlib.contextmanager
def announced(num_microbatches: int):
    """The length of one forward-backward call: its microbatch count is known to the plans it builds."""
    token = _ANNOUNCED.set(num_microbatches)
    try:
        yield
    finally:
        _ANNOUNCED.reset(token)


def step_microbatches() -> tuple[int | None, str]:
    """The current step's microbatch count, and where it came from (None, "": unknown)."""
    count = _ANNOUNCED.get()
    if count is not None:
        return count, "the forward-backward call"
    from megatron.core import num_microbatches_calculator as calculator

    if getattr(calculator, "_GLOBAL_NUM_MICROBATCHES_CALCULATOR", None) is not None:
        return calculator.get_num_microbatches(), "Megatron-Core's num-microbatches calculator"
    return None, ""


class MicrobatchCountsDiffer(RuntimeError):
    """Raised on every rank of an EP group whose ranks run different schedules."""


_FIX = "give every rank the same num_microbatches"


class Agreement:
    """One rank's side of the agreement; ``group``: a gloo group over its EP group (None: nothing to agree)."""

    def __init__(self, group=None):
        self.group = group
        self.size = 1 if group is None else torch.distributed.get_world_size(group)
        self.count: int | None = None  # the agreed count of the current step (None: agreed per call)
        self.collectives = 0

    def start_step(self) -> None:
        self.count, source = step_microbatches()
        if self.count is None or self.size == 1:
            return
        everyone = self._gather([self.count])
        if not torch.equal(everyone, everyone[:1].expand_as(everyone)):
            counts = ", ".join(f"rank {rank}: {int(row[0])}" for rank, row in zip(self._ranks(), everyone.tolist()))
            raise MicrobatchCountsDiffer(
                "EP-overlap schedule: the expert-parallel ranks were given different microbatch counts (their all-to-"
                f"alls pair step by step; counts from {source}): {counts}; {_FIX}"
            )

    def check_plan(self, microbatch: int) -> None:
        if self.count is not None and microbatch >= self.count:
            raise MicrobatchCountsDiffer(
                f"EP-overlap schedule: a plan was built for microbatch {microbatch} of a step agreed at {self.count} "
                f"microbatches (the driver was called with another count than the one announced); {_FIX}"
            )

    def check_call(self, kind: str, vp_stage: int | None, f_mb: int | None, b_mb: int | None) -> None:
        if self.count is not None or self.size == 1:
            return
        row = [_KINDS.index(kind), -1 if vp_stage is None else vp_stage]
        row += [-1 if f_mb is None else f_mb, -1 if b_mb is None else b_mb]
        everyone = self._gather(row)
        if torch.equal(everyone, everyone[:1].expand_as(everyone)):
            return
        raise MicrobatchCountsDiffer(
            "EP-overlap schedule: the expert-parallel ranks were given different microbatch counts (their all-to-"
            "alls pair step by step): "
            + "; ".join(_where(rank, row) for rank, row in zip(self._ranks(), everyone.tolist()))
            + f"; {_FIX}"
        )

    def _gather(self, values: list[int]) -> torch.Tensor:
        mine = torch.tensor(values, dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(self.size)]
        torch.distributed.all_gather(everyone, mine, group=self.group)
        self.collectives += 1
        return torch.stack(everyone)

    def _ranks(self) -> list[int]:
        return torch.distributed.get_process_group_ranks(self.group)


def _where(rank: int, row: list[int]) -> str:
    code, _, f, b = row
    if _KINDS[code] == BACKWARD:  # the last backward of the step: the rank's count is known
        return f"rank {rank} ran its last backward, of microbatch {b} ({b + 1} microbatches)"
    what = f"forward of microbatch {f}" + (f" with the backward of microbatch {b}" if _KINDS[code] == PAIRED else "")
    return f"rank {rank} is at a {_KINDS[code]} step ({what})"
