"""Host work per step, ours beside Megatron-Core's own combined-1F1B plan, under the CUDA emulation on one model
(GPTModel, alltoall, delayed wgrad, EP 2, 2 MoE layers, N = 3, the last step of 2), and the host time of our
per-call program work at 4 and 61 layers. Prints a Markdown table:

    .venv/bin/python -m tests.unit_tests.training.ep_overlap.host_parity
"""

import time

from megatron.bridge.training.ep_overlap.program.interpreter import IssueOrder, run_ops
from megatron.bridge.training.ep_overlap.program.steps import ChunkShape, StepKind, windows_of

from .emulated_arms import emulated_arms
from .local_ranks import run_local_ranks
from .mcore_models import McoreCase

ROWS = ("streams", "events", "timing events", "event records", "host waits", "device-to-host copies",
        "host collectives")  # fmt: skip


class _NoWork:
    """A runner whose every op does nothing: what is left is the program's own host work."""

    issue = IssueOrder.DEVICE

    def __init__(self, layers: int):
        self.layers = [self] * layers

    def __getattr__(self, name):
        return lambda *args: None


def program_ms(layers: int, calls: int = 50) -> float:
    """Host milliseconds per paired driver call of the program's work (windows_of + run_ops), best of 3."""
    shape = ChunkShape(True, True, (False,) + (True,) * (layers - 1))
    runners = {0: _NoWork(layers), 1: _NoWork(layers)}
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            windows = windows_of(StepKind.PAIRED, [0], [1], shape, shape, delay_wgrad=True, window=1)
            run_ops([op for window in windows for op in window.ops], runners)
        best = min(best, (time.perf_counter() - start) / calls * 1e3)
    return best


def main() -> None:
    case = McoreCase(delay_wgrad=True, microbatches=3, steps=2)
    counts = run_local_ranks(emulated_arms, 2, (("mcore", "hook"), case))[0].result
    print("| per step (last of 2) | Megatron-Core's plan | ours |\n|---|---|---|")
    for row in ROWS:
        mcore, hook = (counts[arm]["steps"][-1]["counts"].get(row, 0) for arm in ("mcore", "hook"))
        print(f"| {row} | {mcore} | {hook} |")
    for arm in ("mcore", "hook"):
        assert not counts[arm]["errors"], counts[arm]["errors"][:3]
    print("| race-checker findings | 0 | 0 |")
    for layers in (4, 61):
        print(f"| program work per driver call, {layers} layers (ms) | none (its nodes are built per plan) | "
              f"{program_ms(layers):.2f} |")  # fmt: skip
    print("| activation bytes held | see memory section | see memory section |")


if __name__ == "__main__":
    main()
