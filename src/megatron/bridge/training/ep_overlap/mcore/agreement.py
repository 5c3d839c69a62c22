"""The expert-parallel ranks agree on each step's microbatch count before the step's first all-to-all.

Different counts would hang until the collective timeout; :class:`Agreement` fails every rank at once instead. A count
known at the step's start costs one host all-gather per step; otherwise every driver call is agreed. A rank whose
driver then makes a call the agreed count does not allow (a plan past the count, a backward-only call before the
count's forwards) fails at that call and posts why in the default store; its peers, blocked in that call's
all-to-alls, read it while they wait (:func:`~megatron.bridge.utils.process_groups.set_peer_check`: one store read per
half second of a wait that long, none otherwise) and fail with it.
"""

import contextlib
import contextvars
import functools
import itertools
import time

import torch

from megatron.bridge.utils.process_groups import PEER_POLL, check_peers, set_peer_check

FORWARD, PAIRED, BACKWARD = "forward", "paired", "backward"
_KINDS = (FORWARD, PAIRED, BACKWARD)
_ANNOUNCED: contextvars.ContextVar[int | None] = contextvars.ContextVar("ep_overlap_microbatches", default=None)
_EARLY_BACKWARDS = contextvars.ContextVar("ep_overlap_early_backwards", default=False)


@contextlib.contextmanager
def announced(num_microbatches: int, *, early_backwards: bool = False):
    """The length of one forward-backward call: its microbatch count is known to the plans it builds.
    ``early_backwards``: its schedule makes backward-only calls before its last forward (DualPipeV)."""
    token, early = _ANNOUNCED.set(num_microbatches), _EARLY_BACKWARDS.set(early_backwards)
    try:
        yield
    finally:
        _ANNOUNCED.reset(token)
        _EARLY_BACKWARDS.reset(early)


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
_NOTICE_S = 4 * PEER_POLL.total_seconds()  # how long a failing rank waits for its peers to read why
_SESSIONS = itertools.count()  # every rank makes its agreements in the same order (the hook's install is collective)


class Agreement:
    """One rank's side of the agreement; ``group``: a gloo group over its EP group (None: nothing to agree)."""

    def __init__(self, group=None):
        self.group = group
        self.size = 1 if group is None else torch.distributed.get_world_size(group)
        self.count: int | None = None  # the agreed count of the current step (None: agreed per call)
        self.source = ""
        self.planned = 0  # plans built in the current step (the highest microbatch + 1 of any chunk)
        self.collectives = 0
        self.store, self.key = None, ""
        if self.size > 1:
            self.store = torch.distributed.distributed_c10d._get_default_store()
            self.key = f"ep_overlap/microbatch_counts/{min(self._ranks())}/{next(_SESSIONS)}"
            set_peer_check(self.read_peer_reason)

    def start_step(self) -> None:
        self.count, source = step_microbatches()
        self.source, self.planned = source, 0
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
        self.planned = max(self.planned, microbatch + 1)
        if self.count is not None and microbatch >= self.count:
            self._fail(
                f"rank {torch.distributed.get_rank()}'s driver runs at least {microbatch + 1} microbatches (it built "
                f"a plan for microbatch {microbatch}) in a step agreed at {self.count} (counts from {self.source})"
            )

    def check_call(self, kind: str, vp_stage: int | None, f_mb: int | None, b_mb: int | None) -> None:
        if self.count is not None and kind == BACKWARD and self.planned < self.count and not _EARLY_BACKWARDS.get():
            # Backward-only calls come after every forward of the step (the cooldown): this driver ran fewer.
            self._fail(
                f"rank {torch.distributed.get_rank()}'s driver ran {self.planned} microbatches in a step agreed at "
                f"{self.count} (counts from {self.source}): it reached the backward-only calls after the forward of "
                f"microbatch {self.planned - 1}"
            )
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

    def _fail(self, reason: str) -> None:
        """Posts ``reason`` for the peers blocked in this call, waits a moment for them to read it, raises it."""
        message = f"EP-overlap schedule: the expert-parallel ranks run different microbatch counts: {reason}; {_FIX}"
        if self.store is not None:
            try:
                self.store.set(self.key, message)
                deadline = time.monotonic() + _NOTICE_S
                while self.store.add(f"{self.key}/read", 0) < self.size - 1 and time.monotonic() < deadline:
                    time.sleep(0.02)
            except (RuntimeError, OSError):  # the store's host read it and is gone
                pass
        raise MicrobatchCountsDiffer(message)

    def read_peer_reason(self) -> None:
        """The peer check of this rank's waits: raises the reason a peer posted, if one did."""
        if self.store is None:
            return
        try:
            if not self.store.check([self.key]):
                return
            message = self.store.get(self.key).decode()
            self.store.add(f"{self.key}/read", 1)
        except (RuntimeError, OSError):  # the store's host is gone (it may have been the failing rank)
            return
        raise MicrobatchCountsDiffer(f"{message} (rank {torch.distributed.get_rank()} stopped with it)")

    def _gather(self, values: list[int]) -> torch.Tensor:
        mine = torch.tensor(values, dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(self.size)]
        torch.distributed.all_gather(everyone, mine, group=self.group)
        self.collectives += 1
        return torch.stack(everyone)

    def _ranks(self) -> list[int]:
        return torch.distributed.get_process_group_ranks(self.group)


def stops_with_a_peers_reason(run):
    """Wraps a plan's ``run``: an error there after a peer posted why it stopped (a collective that peer left, e.g.
    one of Megatron-Core's own in the dispatcher, failing as its process ends) is raised as that reason."""

    @functools.wraps(run)
    def wrapped(*args, **kwargs):
        try:
            return run(*args, **kwargs)
        except MicrobatchCountsDiffer:
            raise
        except Exception as error:
            try:
                check_peers()
            except MicrobatchCountsDiffer as reason:
                raise reason from error
            raise

    return wrapped


def _where(rank: int, row: list[int]) -> str:
    code, _, f, b = row
    if _KINDS[code] == BACKWARD:  # the last backward of the step: the rank's count is known
        return f"rank {rank} ran its last backward, of microbatch {b} ({b + 1} microbatches)"
    what = f"forward of microbatch {f}" + (f" with the backward of microbatch {b}" if _KINDS[code] == PAIRED else "")
    return f"rank {rank} is at a {_KINDS[code]} step ({what})"
