"""Test-only: Megatron-Core's plan and ours, each trained under the CUDA emulation (``cuda_emulation.py``) on one
model, with what the emulation found and counted per step."""

from .mcore_arms import run_arm
from .mcore_cpu import init_megatron, install_cpu_stubs
from .mcore_models import McoreCase


def emulated_arms(
    rank: int,
    world: int,
    arms: tuple[str, ...],
    case: McoreCase,
    pipeline: bool = False,
    plant=None,
    setup: str | None = None,
) -> dict[str, dict]:
    """Each of ``arms`` ("plain", "mcore" or "hook"), in turn on this rank's one emulated device (a fresh model
    each; put "plain" first: it runs on the default stream alone): per arm its losses, gradients, the errors found
    while it ran, each step's counts. ``setup``: "static-flex" (the static-shape HybridEP stand-in),
    "graphed-preprocess" (TE-style graphs of attention, router and ``moe_preprocess``, static output buffers) or
    "fp8" (mxfp8: ``test_quantization``'s stand-in contexts, and its checkpoint of a quantized block) or "latent"
    (latent MoE's projections)."""
    emu = emulate()
    init_megatron(world // 2 if pipeline else world, pipeline=2 if pipeline else 1, virtual=2 if pipeline else None)
    if plant is not None:
        plant(emu)
    prepare = _prepare(setup, case)
    out = {}
    for arm in arms:
        steps, found = [], len(emu.errors)

        def around_step(steps=steps):
            steps.append(None)
            return _Counted(emu, steps)

        result = run_arm(arm, case, pipeline=pipeline, around_step=around_step, prepare=prepare)
        out[arm] = {
            "losses": [None if loss is None else loss.tolist() for loss in result["losses"]],
            "grads": {name: grad.clone() for name, grad in result["grads"].items()},
            "errors": emu.errors[found:],
            "steps": steps,
        }
    return out


def emulate():
    """This (forked) rank under the emulation, before Megatron is initialized: the CPU stubs, the emulated device,
    the hook's CUDA lane on it, every kernel labelled with its node. Returns the emulation."""
    from . import cuda_emulation

    install_cpu_stubs()
    emu = cuda_emulation.install()
    _cuda_lane_on_cpu()
    _labelled(emu)
    return emu


class _Counted:
    def __init__(self, emu, steps: list):
        self.emu, self.steps = emu, steps

    def __enter__(self):
        self.window = self.emu.counting()
        self.counts = self.window.__enter__()

    def __exit__(self, *exc):
        self.window.__exit__(*exc)
        waits = [(w.issued, w.stream, w.what, w.beyond) for w in self.emu.host_waits]
        self.steps[-1] = {"counts": dict(self.counts), "host_waits": waits}


def _cuda_lane_on_cpu() -> None:
    """The hook picks its lane by the parameters' device: here the CUDA lane, on the emulated streams."""
    import torch

    from megatron.bridge.training.ep_overlap.mcore import hook

    make_lane = hook.make_lane
    hook.make_lane = lambda groups, device, **kwargs: make_lane(groups, torch.device("cuda"), **kwargs)


def _labelled(emu) -> None:
    """The kernels of each node carry its name: ours by the lane's compute nodes, Megatron-Core's by its
    ``ScheduleNode`` (``"<name> forward"``/``"<name> backward"``)."""
    from contextlib import contextmanager

    from megatron.core.pipeline_parallel.utils import ScheduleNode

    from megatron.bridge.training.ep_overlap.runtime.lanes import CudaLane, _Lane

    def labelled(enter, label_of):
        @contextmanager
        def wrapped(self, *args, **kwargs):
            outer, emu.label = emu.label, label_of(*args, **kwargs)
            try:
                with enter(self, *args, **kwargs):
                    yield
            finally:
                emu.label = outer

        return wrapped

    _Lane.compute = labelled(_Lane.compute, lambda node, *rest: node)

    def comm_labelled(launch):
        def wrapped(self, *args, op, **kwargs):
            outer, emu.label = emu.label, f"comm {op}"
            try:
                return launch(self, *args, op=op, **kwargs)
            finally:
                emu.label = outer

        return wrapped

    CudaLane.run_comm, CudaLane.all_to_all = comm_labelled(CudaLane.run_comm), comm_labelled(CudaLane.all_to_all)
    ScheduleNode.stream_acquire_context = labelled(ScheduleNode.stream_acquire_context, lambda name=None: name)


def _prepare(setup: str | None, case: McoreCase):
    if setup == "static-flex":
        from .static_hybridep import install_static_hybridep, make_static

        install_static_hybridep()
        return make_static
    if setup == "graphed-preprocess":
        from . import graph_standin

        graph_standin.install()

        def graphed(model) -> None:
            graph_standin.capture(model, case.microbatches, ["attn", "moe_router", "moe_preprocess"], static=True)
            for module in model.modules():  # what the dispatcher picks when built with moe_preprocess graphed
                dispatcher = getattr(module, "token_dispatcher", None)
                if hasattr(dispatcher, "cuda_dtoh_point"):
                    dispatcher.cuda_dtoh_point = "before_ep_alltoall"

        return graphed
    if setup == "fp8":
        from . import quantization_spy
        from .test_quantization import MXFP8, _low_precision, _te_checkpoint_on_cpu

        quantization_spy.install()
        _te_checkpoint_on_cpu()
        import megatron.core.extensions.transformer_engine as te
        import megatron.core.recompute as recompute

        te.te_checkpoint = recompute.te_checkpoint  # the MTP layer imports it from there when it recomputes
        return _low_precision(MXFP8)
    if setup == "latent":  # the latent projections, as Transformer Engine's deferring linear (family_models)
        from .family_models import install_latent_projections

        install_latent_projections()
        return None
    assert setup is None, setup
    return None
