"""The forward-backward function for a training loop: Megatron-Core's, or ours where Megatron-Core has no EP overlap.

Contract:
    * :func:`get_forward_backward_func` takes Megatron-Core's arguments and returns Megatron-Core's own function
      everywhere except one layout: pipeline parallelism (PP > 1) without virtual stages, with
      ``overlap_moe_expert_parallel_comm`` on, where Megatron-Core has no overlapped schedule (its config refuses the
      flag there). It then returns :func:`forward_backward_pipelining_with_ep_overlap`, which takes the same
      arguments and returns the same value (the last stage's loss-function outputs, one per microbatch).
    * That schedule is the plain 1F1B pipeline with one more warm-up forward, so that each steady step pairs the
      forward of one microbatch with the backward of another, independent of it: stage ``s`` of ``P`` holds
      ``2 (P - s)`` microbatches in flight where plain 1F1B holds ``P - s``. The step order is Megatron-Core's
      interleaved schedule with one model chunk per rank (its count of warm-up forwards then is ``2 (P - s - 1) + 1``
      with the overlap), and each paired step runs this project's plan through the pre-wrap hook
      (``use_ep_overlap_schedule``), as under the interleaved schedule.
    * Fewer microbatches than stages cannot be grouped that way (Megatron-Core's table needs ``N >= P``): such a step,
      and a forward-only one, runs Megatron-Core's non-interleaved schedule, unpaired, with the same numbers.
    * Losses and gradients are bitwise equal to Megatron-Core's non-interleaved schedule with the overlap off
      (tests: PP 2 and PP 4, ``N`` a multiple of PP and not, MTP, delayed wgrad, full recompute, the flex stand-in,
      ``HybridModel``).
    * A training loop must take its function from here for that layout: :func:`unpaired_loop_problem` says when
      Megatron-Bridge's ``train()`` (module ``megatron.bridge.training.train``, once imported) takes
      Megatron-Core's, which would run every step unpaired; the hook refuses then, naming the patch.
"""

import contextlib
import copy
import functools
import sys

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules
from megatron.core.utils import get_model_config

from megatron.bridge.training.ep_overlap.mcore.agreement import announced


def get_forward_backward_func(pp_size: int | None = None, vp_size: int | None = None, **kwargs):
    """Megatron-Core's ``get_forward_backward_func`` (same arguments), but for PP > 1 without virtual stages:
    :func:`forward_backward_pipelining_with_ep_overlap`, which runs Megatron-Core's plain schedule unless the
    model's config turns ``overlap_moe_expert_parallel_comm`` on. Either way the function announces each call's
    microbatch count to the plans it builds (``agreement.announced``), so the EP ranks agree on it once per step."""
    mcore = schedules.get_forward_backward_func(pp_size, vp_size, **kwargs)
    if mcore is schedules.forward_backward_pipelining_without_interleaving:
        return forward_backward_pipelining_with_ep_overlap
    return _announcing(mcore)


def _announcing(function):
    """``function`` (one of Megatron-Core's schedules), its microbatch count announced for the length of a call."""

    @functools.wraps(function)
    def call(*args, num_microbatches: int, **kwargs):
        with announced(num_microbatches):
            return function(*args, num_microbatches=num_microbatches, **kwargs)

    call.schedule = function  # which of Megatron-Core's schedules it runs
    return call


def forward_backward_pipelining_with_ep_overlap(*, forward_step_func, data_iterator, model, num_microbatches, **kw):
    """Megatron-Core's non-interleaved schedule's arguments and result (see the module docstring)."""
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
    """Megatron-Core's interleaved schedule over one model chunk per rank: one virtual stage, every microbatch in one
    group (so the table is microbatch order), asynchronous P2P; for the length of one call, then as it was.

    Only the config says "one virtual stage" (the schedule builds its P2P communicator, and so counts its warm-up,
    from it). ``parallel_state`` keeps saying there are none: the chunks were built without a ``vp_stage``, and
    Megatron-Core's layout and MTP helpers (``get_mtp_layer_offset`` with a ``pipeline_model_parallel_layout``)
    assert one when it says there are virtual stages."""
    fields = {
        "virtual_pipeline_model_parallel_size": 1,
        "microbatch_group_size_per_vp_stage": num_microbatches,
        # Asynchronous P2P: Megatron-Core hands the plan its hooks, and the plan waits where the data is read.
        "overlap_p2p_comm": True,
        "batch_p2p_comm": False,
        # The interleaved schedule starts the parameter sync of two chunks, and makes the grad sync function a list
        # in the config; the plain schedule calls neither (the DDP's own hooks do the parameter gather).
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
    """Why Megatron-Bridge's ``train()`` would run ``config``'s model unpaired, with the fix; None when it would
    not (the layout has virtual stages or none, the overlap is off, the loop is not imported, or it takes
    :func:`get_forward_backward_func` from here)."""
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
