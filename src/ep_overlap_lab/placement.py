"""Where the delayed attention wgrad goes, chosen by the planner from a plain step's records (``EPOverlapEngine``'s
``attention_wgrad_window=None``).

Contract:
    * With ``attention_wgrad_window=None`` (auto, PP = 1) ``EPOverlapEngine``'s first training step runs the plain
      path, which is bitwise the same step (overlap changes no number) and whose records are exactly the planner's
      per-window costs (the link is fitted to that step's all-to-alls). The planner simulates the overlapped step
      with the attention wgrad in window 1 and in window 2, and every later step runs the faster one: the window
      reaches the engine's settings as a value (``ep_overlap_engine.placed``).
    * Every rank decides alike: the predicted step times are summed over all ranks (one small all-reduce) before
      the comparison, so the placement never differs between ranks. A tie keeps window 1.
    * The outcome is :class:`WgradPlacement`, kept as ``engine.placement`` and logged on rank 0, so a launcher can
      print it and write it to its results. Without delayed wgrad there is nothing to place: window 1 at once.
"""

import logging
from dataclasses import dataclass

import torch

from ep_overlap_lab.collectives import all_reduce
from ep_overlap_lab.planner import costs_from_records, step_by_wgrad_window
from ep_overlap_lab.step_stats import records_as_dict
from megatron.bridge.training.ep_overlap.options import EPOverlapOptions
from megatron.bridge.training.ep_overlap.runtime.records import StepRecorder
from megatron.bridge.utils.process_groups import EPGroups

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WgradPlacement:
    """The chosen attention-wgrad window and what the planner predicted for each (step seconds, summed over ranks
    and divided by their number)."""

    window: int
    predicted_step_s: dict[int, float]

    def describe(self) -> str:
        options = ", ".join(f"window {w} {s:.3f} s" for w, s in sorted(self.predicted_step_s.items()))
        return f"attention wgrad in window {self.window} (auto: the planner predicted {options} per step)"


def choose_wgrad_window(
    recorder: StepRecorder,
    step_s: float,
    num_microbatches: int,
    num_layers: int,
    groups: EPGroups,
    device: torch.device,
    options: EPOverlapOptions,
    segments: tuple[tuple[int, int], ...] = (),
) -> WgradPlacement:
    """The planner's window for the costs of one plain step (``recorder``, ``step_s``), agreed on by every rank;
    ``options`` as the overlapped steps will run (``launch_off_host``: whether their lane does)."""
    costs, link = costs_from_records([records_as_dict(recorder)], [step_s], None, num_layers, segments)
    mine = step_by_wgrad_window(costs, link, num_microbatches, options)
    windows = sorted(mine)
    totals = torch.tensor([mine[w] for w in windows], dtype=torch.float64, device=device)
    world = 1
    if torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
        all_reduce(totals, None, op="attention wgrad placement", timeout=groups.timeout)
    predicted = {w: t / world for w, t in zip(windows, totals.tolist())}
    window = min(windows, key=lambda w: (predicted[w], w))
    placement = WgradPlacement(window, predicted)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        logger.info("EP overlap: %s", placement.describe())
    return placement
