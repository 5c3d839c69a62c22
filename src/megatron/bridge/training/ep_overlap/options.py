"""The EP-overlap schedule's options, in one frozen object (no torch here); ``settings.resolve`` checks them."""

from dataclasses import dataclass
from typing import Any

WGRAD_WINDOWS = (1, 2)  # where a paired layer step may put the previous layer's delayed attention wgrad


@dataclass(frozen=True)
class EPOverlapOptions:
    """How the schedule runs.

    Attributes:
        overlap: Pair microbatches so each all-to-all hides behind the other's compute; False: the plain path.
        delay_wgrad: Defer expert and attention weight gradients into the windows that have comm to hide.
        attention_wgrad_window: 1 (beside B.combine backward) or 2 (beside F.dispatch); None: the planner picks.
        edge_pairing: At PP = 1, pair the warm-up's two forwards and the cool-down's two backwards (bitwise).
        moe_ep_overlap_chunks: 2 splits each lone microbatch into two batch halves run as a pair (PP = 1; not bitwise).
        launch_off_host: On CPU, launch all-to-alls from a helper thread (None: where it applies).
        check_for_nan_in_loss_and_grad: After the backward, fail every rank at once on a non-finite loss or gradient.
    """

    overlap: bool = True
    delay_wgrad: bool = False
    attention_wgrad_window: int | None = 1
    edge_pairing: bool = False
    moe_ep_overlap_chunks: int = 1
    launch_off_host: bool | None = None
    high_priority_comm: bool = False
    check_for_nan_in_loss_and_grad: bool = True

    @classmethod
    def from_config(cls, config: Any, **overrides: Any) -> "EPOverlapOptions":
        """Overlap and delayed wgrad from a model config's flags, the rest from ``overrides``."""
        resolved = {
            "overlap": bool(getattr(config, "overlap_moe_expert_parallel_comm", False)),
            "delay_wgrad": bool(getattr(config, "delay_wgrad_compute", False)),
        }
        return cls(**(resolved | overrides))
