"""Megatron-FSDP (``FullyShardedDataParallel``, ``optim_grads_params``) under Megatron-Core's combined-1F1B driver
running this project's plan: losses, reduced gradients and two Adam steps bitwise equal to Megatron-Core's plain
path with FSDP and the overlap off, and the driver's per-layer parameter releases made by the plan's nodes. With an
MTP layer, whose embedding call runs on per-microbatch aliases of the embedding's weights, FSDP's gather hooks still
see only the real parameters.

Test-only stand-ins, besides ``mcore_cpu``'s: Megatron-FSDP builds its device meshes with ``device_type="cuda"``
(``mcore_fsdp_adapter.py`` ``_init_dist_index``), compares its device with ``cuda:<current_device>`` when it wraps,
and fuses the gradient division into an NCCL pre-multiplied sum (``gradient_reduce_div_fusion``), which gloo lacks.
"""

import dataclasses
import functools
from datetime import timedelta

import pytest
import torch

from .bitwise import assert_steps_bitwise
from .local_ranks import run_local_ranks
from .mcore_cpu import init_megatron, install_cpu_stubs
from .mcore_models import McoreCase, build_model
from .test_mcore_hook import MICRO_BATCH, SEQ, bridge_style_forward_step

CASE = McoreCase(microbatches=3, layer_freq=(0, 1, 1))  # a dense layer before two MoE layers
CASES = {"dense-moe-moe": CASE, "dense-moe-moe-mtp": dataclasses.replace(CASE, mtp=True)}


def _fsdp_on_cpu(model):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter
    from torch.distributed.device_mesh import DeviceMesh

    class CpuMesh:
        @staticmethod
        def from_group(*args, device_type=None, **kwargs):
            return DeviceMesh.from_group(*args, device_type="cpu", **kwargs)

    mcore_fsdp_adapter.DeviceMesh = CpuMesh
    ddp = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        use_distributed_optimizer=True,
        data_parallel_sharding_strategy="optim_grads_params",
        gradient_reduce_div_fusion=False,
    )
    current_device, torch.cuda.current_device = torch.cuda.current_device, lambda: 0
    try:
        return mcore_fsdp_adapter.FullyShardedDataParallel(model.config, ddp, model, device=torch.device("cpu"))
    finally:
        torch.cuda.current_device = current_device


def _counted(fsdp, name: str, counts: dict) -> None:
    release = getattr(fsdp, name)

    def counted(module):
        counts[name] = counts.get(name, 0) + 1
        return release(module)

    setattr(fsdp, name, counted)


def train_fsdp(case: McoreCase, rank: int, world: int) -> dict:
    install_cpu_stubs()
    init_megatron(world)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron.bridge.training.ep_overlap.mcore import use_ep_overlap_schedule

    out = {}
    for arm in ("plain", "overlap"):
        model = build_model(case)
        if arm == "overlap":  # before the wrap: Megatron-FSDP reads it for its fine-grained gather hooks
            model.config.overlap_moe_expert_parallel_comm = True
            use_ep_overlap_schedule([model], timeout=timedelta(seconds=30))
        wrapped = _fsdp_on_cpu(model)
        releases = {}
        for name in ("post_forward_release_module", "post_backward_release_module"):
            _counted(wrapped.module, name, releases)
        shards = dict(wrapped.module.param_and_grad_buffer.optimizer_named_parameters)
        optimizer = torch.optim.Adam(shards.values(), lr=1e-2)
        losses, grads = [], []
        for step in range(case.steps):
            gen = torch.Generator().manual_seed(100 * step + rank)
            data = [tuple(torch.randint(0, 64, (2, MICRO_BATCH, SEQ), generator=gen)) for _ in range(3)]
            wrapped.zero_grad_buffer()
            store = get_forward_backward_func()(
                forward_step_func=bridge_style_forward_step, data_iterator=iter(data), model=[wrapped],
                num_microbatches=case.microbatches, seq_length=SEQ, micro_batch_size=MICRO_BATCH, forward_only=False,
            )  # fmt: skip
            wrapped.finish_grad_sync()
            losses.append(torch.stack([logged["lm loss"] for logged in store]))
            grads.append({n: p.grad.to_local().clone() for n, p in shards.items() if p.grad is not None})
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            wrapped.module.install_optimized_model_weights()
        out[arm] = {"losses": losses, "grads": grads, "releases": releases}
    assert_steps_bitwise(out["plain"], out["overlap"], case.steps, rank)
    return out["overlap"]["releases"]


# The MTP case runs every FSDP hook the plain one does, and the MTP embedding's too: the plain one is behind -m wide.
@pytest.mark.parametrize("name", [pytest.param("dense-moe-moe", marks=pytest.mark.wide), "dense-moe-moe-mtp"])
def test_megatron_fsdp_under_the_hook_is_bitwise_equal_and_releases_each_layer(name):
    case = CASES[name]
    # Each decoder layer (the plan runs each by parts, the dense one too) once per microbatch and step.
    each = len(case.layer_freq) * case.microbatches * case.steps
    for outcome in run_local_ranks(functools.partial(train_fsdp, case), case.world):
        assert outcome.result == {"post_forward_release_module": each, "post_backward_release_module": each}
