"""Test-only: Megatron-Core's plan and ours, each trained under the CUDA emulation (``cuda_emulation.py``) on one
model, with what the emulation found and counted per step."""

from .mcore_arms import run_arm
from .mcore_cpu import init_megatron, install_cpu_stubs
from .mcore_models import McoreCase


def emulated_arm(rank: int, world: int, arm: str, case: McoreCase, pipeline: bool = False, plant=None) -> dict:
    """``arm`` ("plain", "mcore" or "hook") under the emulation: losses, gradients, errors, each step's counts."""
    from . import cuda_emulation

    install_cpu_stubs()
    emu = cuda_emulation.install()
    init_megatron(world, pipeline=2 if pipeline else 1, virtual=2 if pipeline else None)
    _cuda_lane_on_cpu()
    if plant is not None:
        plant(emu)
    steps = []

    def around_step():
        steps.append(None)
        return _Counted(emu, steps)

    result = run_arm(arm, case, pipeline=pipeline, around_step=around_step)
    return {
        "losses": [None if loss is None else loss.tolist() for loss in result["losses"]],
        "grads": {name: grad.clone() for name, grad in result["grads"].items()},
        "errors": list(emu.errors),
        "steps": steps,
        "kernels": emu.kernels,
    }


class _Counted:
    def __init__(self, emu, steps: list):
        self.emu, self.steps = emu, steps

    def __enter__(self):
        self.window = self.emu.counting()
        self.counts = self.window.__enter__()

    def __exit__(self, *exc):
        self.window.__exit__(*exc)
        waits = [(w.issued, w.stream, w.what) for w in self.emu.host_waits]
        self.steps[-1] = {"counts": dict(self.counts), "host_waits": waits}


def _cuda_lane_on_cpu() -> None:
    """The hook picks its lane by the parameters' device: here the CUDA lane, on the emulated streams."""
    import torch

    from megatron.bridge.training.ep_overlap.mcore import hook

    make_lane = hook.make_lane
    hook.make_lane = lambda groups, device, **kwargs: make_lane(groups, torch.device("cuda"), **kwargs)
