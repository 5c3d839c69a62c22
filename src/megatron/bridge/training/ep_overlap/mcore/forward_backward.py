"""The forward-backward function for a training loop: Megatron-Core's, or ours where Megatron-Core has no EP overlap.

For PP > 1 without virtual stages (where Megatron-Core's config refuses the overlap flag), training with the overlap on
and N >= P runs Megatron-Core's interleaved schedule over one chunk per rank, so steady steps pair two microbatches;
bitwise equal to the non-interleaved schedule with the overlap off.
"""

import contextlib
import copy
import functools
import sys

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules
from megatron.core.utils import get_model_config

from megatron.bridge.training.ep_overlap.mcore.agreement import announced
from megatron.bridge.training.ep_overlap.mcore.dualpipev import dualpipev_requested, forward_backward_dualpipev


def get_forward_backward_func(pp_size: int | None = None, vp_size: int | None = None, **kwargs):
    """Megatron-Core's ``get_forward_backward_func``, with ours for PP > 1 without virtual stages; with PP > 1 a model
    config whose ``ep_overlap_pipeline_schedule`` is ``"dualpipev"`` runs :func:`forward_backward_dualpipev`."""
    mcore = schedules.get_forward_backward_func(pp_size, vp_size, **kwargs)
    if mcore is schedules.forward_backward_pipelining_without_interleaving:
        return forward_backward_pipelining_with_ep_overlap
    return _announcing(mcore)


def _announcing(function):
    @functools.wraps(function)
    def call(*args, num_microbatches: int, **kwargs):
        if function is not schedules.forward_backward_no_pipelining and dualpipev_requested(kwargs["model"]):
            return forward_backward_dualpipev(num_microbatches=num_microbatches, **kwargs)
        with announced(num_microbatches):
            return function(*args, num_microbatches=num_microbatches, **kwargs)

    call.schedule = function
    return call


def forward_backward_pipelining_with_ep_overlap(*, forward_step_func, data_iterator, model, num_microbatches, **kw):
    """Megatron-Core's non-interleaved schedule's arguments and result (see the module docstring)."""
    if dualpipev_requested(model):
        return forward_backward_dualpipev(
            forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
            num_microbatches=num_microbatches, **kw,
        )  # fmt: skip
    with announced(num_microbatches):
        return _plain_pipeline(forward_step_func, data_iterator, model, num_microbatches, kw)


def _plain_pipeline(forward_step_func, data_iterator, model, num_microbatches: int, kw: dict):
    models = model if isinstance(model, list) else [model]
    config = get_model_config(models[0])
    pipeline = parallel_state.get_pipeline_model_parallel_world_size()
    if not config.overlap_moe_expert_parallel_comm:
        return schedules.forward_backward_pipelining_without_interleaving(
            forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
            num_microbatches=num_microbatches, **kw,
        )  # fmt: skip
    if kw.get("forward_only") or num_microbatches < pipeline:
        with _overlap_off(config):  # Megatron-Core's plain forward and backward, unpaired
            return schedules.forward_backward_pipelining_without_interleaving(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                num_microbatches=num_microbatches, **kw,
            )  # fmt: skip
    iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
    if kw.get("p2p_communicator") is not None:  # it counts the warm-up from the virtual size it was built with
        kw["p2p_communicator"] = copy.copy(kw["p2p_communicator"])
        kw["p2p_communicator"].virtual_pipeline_model_parallel_size = 1
    with _one_virtual_stage(config, num_microbatches):
        return schedules.forward_backward_pipelining_with_interleaving(
            forward_step_func=forward_step_func, data_iterator=iterators, model=models,
            num_microbatches=num_microbatches, **kw,
        )  # fmt: skip


@contextlib.contextmanager
def _overlap_off(config):
    config.overlap_moe_expert_parallel_comm = False
    try:
        yield
    finally:
        config.overlap_moe_expert_parallel_comm = True


@contextlib.contextmanager
def _one_virtual_stage(config, num_microbatches: int):
    """Megatron-Core's interleaved schedule over one chunk per rank. ``parallel_state`` still says no virtual stages:
    the chunks have no ``vp_stage``, which ``get_mtp_layer_offset`` (with a layout) asserts when it says there are."""
    fields = {
        "virtual_pipeline_model_parallel_size": 1,
        "microbatch_group_size_per_vp_stage": num_microbatches,
        # Asynchronous P2P: Megatron-Core hands the plan its hooks, and the plan waits where the data is read.
        "overlap_p2p_comm": True,
        "batch_p2p_comm": False,
        # Else the interleaved schedule starts two chunks' param sync and makes grad_sync_func a list (plain: neither).
        "param_sync_func": None,
        "grad_sync_func": config.grad_sync_func,
    }
    saved = {name: getattr(config, name) for name in fields}
    for name, value in fields.items():
        setattr(config, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


# Megatron-Bridge's training loop: the patch makes it take get_forward_backward_func from this module.
_BRIDGE_LOOP = "megatron.bridge.training.train"


def unpaired_loop_problem(config) -> str | None:
    """Why Bridge's ``train()`` would run ``config``'s plain 1F1B pipeline unpaired, with the fix; else None."""
    pipeline, virtual = config.pipeline_model_parallel_size or 1, config.virtual_pipeline_model_parallel_size
    plain_pipeline = pipeline > 1 and virtual is None
    loop = sys.modules.get(_BRIDGE_LOOP)
    if not (plain_pipeline and config.overlap_moe_expert_parallel_comm) or loop is None:
        return None
    if getattr(loop, "get_forward_backward_func", None) is get_forward_backward_func:
        return None
    return (
        "overlap_moe_expert_parallel_comm with pipeline_model_parallel_size="
        f"{config.pipeline_model_parallel_size} and no virtual stages: Megatron-Bridge's train() (unpatched) takes "
        "Megatron-Core's get_forward_backward_func, whose plain 1F1B schedule pairs nothing, so every step would "
        "run unoverlapped; fix: apply this project's patch (tools/upstream.py patch), which makes train() take "
        "megatron.bridge.training.ep_overlap.mcore.get_forward_backward_func, or set "
        "virtual_pipeline_model_parallel_size"
    )
