"""The EP-overlap schedule's options, in one frozen object (no torch here).

Every consumer takes the same object: the engine, the planner, the program, the harness and the Megatron-Core hook.
What may not be combined is refused by the rules table: ``settings.resolve`` checks a model config with these options
(one line per problem with its fix, the same line wherever it is checked). What they resolve to (delayed wgrad only
with overlap, the attention wgrad's window where it is None) is ``settings.Settings``' to say, not a consumer's.
"""

from dataclasses import dataclass
from typing import Any

WGRAD_WINDOWS = (1, 2)  # where a paired layer step may put the previous layer's delayed attention wgrad


@dataclass(frozen=True)
class EPOverlapOptions:
    """How the schedule runs.

    Attributes:
        overlap: Pair microbatches so each all-to-all hides behind the other microbatch's compute; False runs the
            plain path (ordinary autograd, blocking all-to-alls), the reference every option is bitwise equal to.
        delay_wgrad: Defer expert and attention weight gradients into the windows that have comm to hide.
        attention_wgrad_window: With delayed wgrad, the window of the next layer step that runs a layer's attention
            wgrad: 1 (beside B.combine backward) or 2 (beside F.dispatch). None (auto, PP = 1): ``EPOverlapEngine``'s
            first training step runs the plain path and the planner picks the window from its costs (``Settings``
            resolves what None means: ``wgrad_window_auto``, ``attention_wgrad_window``, ``placed``).
        edge_pairing: At PP = 1, pair the warm-up's two forwards and the cool-down's two backwards instead of
            running one microbatch alone at each end (bitwise; one more microbatch's activations alive).
        moe_ep_overlap_chunks: 2 splits each microbatch that would run alone in two halves along the batch and runs
            them as a pair (PP = 1; not bitwise: a chunked microbatch's loss and gradients sum two halves).
        launch_off_host: On CPU, launch all-to-alls from one helper thread whenever one must wait, so a dispatch
            waiting for its split sizes does not stop the host. None: wherever it applies; True insists.
        high_priority_comm: On CUDA, give the comm stream high priority.
        check_for_nan_in_loss_and_grad: After the backward, fail every rank at once when any rank's loss or
            gradient is not finite, naming the rank and the microbatch (Megatron-Core's check, on by default there).
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
        """Overlap and delayed wgrad as a model config resolves them (``overlap_moe_expert_parallel_comm``,
        ``delay_wgrad_compute``), the rest from ``overrides``."""
        resolved = {
            "overlap": bool(getattr(config, "overlap_moe_expert_parallel_comm", False)),
            "delay_wgrad": bool(getattr(config, "delay_wgrad_compute", False)),
        }
        return cls(**(resolved | overrides))
