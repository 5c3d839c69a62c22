"""The engine users build: :class:`EPOverlapEngine`, the engine (``driver.py``) that also lets the planner place the
delayed attention wgrad.

Contract:
    * ``EPOverlapEngine`` is :class:`~ep_overlap_lab.engine.driver.Engine` plus one thing:
      ``attention_wgrad_window=None`` with delayed wgrad (auto, PP = 1; ``Settings.wgrad_window_auto``). Its first
      training step then runs the plain path (bitwise the same step) and ``placement.choose_wgrad_window`` picks the
      window from that step's records; :func:`placed` makes it the engine's settings, and every later step runs
      it. Without delayed wgrad there is nothing to place (``Settings`` resolves None to window 1).
"""

import time
from dataclasses import replace

from ep_overlap_lab.engine.driver import Engine, StepResult
from ep_overlap_lab.placement import WgradPlacement, choose_wgrad_window
from megatron.bridge.training.ep_overlap.options import WGRAD_WINDOWS, EPOverlapOptions
from megatron.bridge.training.ep_overlap.settings import Settings
from megatron.bridge.utils.process_groups import EPGroups


class EPOverlapEngine(Engine):
    """Runs training steps with the EP-overlap schedule (see :class:`Engine`); ``attention_wgrad_window=None``
    lets the planner place the delayed attention wgrad (see the module docstring)."""

    def __init__(self, model, groups: EPGroups, options: EPOverlapOptions | None = None, **fields):
        super().__init__(model, groups, options, **fields)
        self.placement: WgradPlacement | None = None

    def step(self, microbatches, *, forward_only: bool = False) -> StepResult:
        if forward_only or not self.settings.wgrad_window_auto:
            return super().step(microbatches, forward_only=forward_only)
        start = time.perf_counter()
        result = self._step(microbatches, plain(self.settings), forward_only=False)
        device = next(self.chunks[0].parameters()).device
        overlapped = replace(self.options, launch_off_host=self.launches_off_host(device))
        self.placement = choose_wgrad_window(
            result.recorder, time.perf_counter() - start, len(microbatches), len(self.chunks[0].layers),
            self.groups, device, overlapped, self.shapes[0].segments,
        )  # fmt: skip
        self.settings = placed(self.settings, self.placement.window)
        return result


def placed(settings: Settings, window: int) -> Settings:
    """``settings`` with the planner's chosen attention-wgrad ``window``."""
    if window not in WGRAD_WINDOWS:
        raise ValueError(f"the planner chose attention wgrad window {window!r}, not one of {WGRAD_WINDOWS}")
    return replace(settings, options=replace(settings.options, attention_wgrad_window=window))


def plain(settings: Settings) -> Settings:
    """``settings`` for one plain-path step; the violations stay these settings'."""
    return replace(settings, options=replace(settings.options, overlap=False))
