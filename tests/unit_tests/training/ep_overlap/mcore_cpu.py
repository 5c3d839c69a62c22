"""Test-only: lets Megatron-Core's MoE layers run on CPU ranks (gloo). Never imported by product code.

Megatron-Core calls a few ``torch.cuda`` stream/event/device functions directly, forks a CUDA RNG state for
attention dropout (and saves it around a recompute), and passes all-to-all split sizes as tensors (gloo wants
lists). On CPU these become no-op streams and events, the current device "cpu" (also where the schedules' token
counter goes, and the tensors its optimizer and masks make there), a plain RNG context, and list splits. Expert
tensor parallelism gathers each rank's received tokens, a different count per rank, and gloo's all-gather wants
equal sizes: the gather pads them to the longest.
"""

import contextlib
from types import SimpleNamespace

import torch
import torch.distributed as dist


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def wait(self, *args, **kwargs):
        pass

    def query(self):
        return True


class _Stream(_Event):
    @staticmethod
    def priority_range():  # Megatron-Core asks for a high-priority comm stream (high_priority_a2a_comm_stream)
        return 0, -1

    def wait_stream(self, *args):
        pass

    def wait_event(self, *args):
        pass

    def record_event(self, *args):
        return _Event()

    def __eq__(self, other):
        return isinstance(other, _Stream)

    def __hash__(self):
        return 0


def install_cpu_stubs() -> None:
    """Patches torch.cuda and dist for this (forked test) process only."""
    current = _Stream()
    torch.cuda.Stream, torch.cuda.Event = _Stream, _Event
    torch.cuda.current_stream = lambda *args, **kwargs: current
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.Tensor.record_stream = lambda self, stream: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # the last stage's embedding copy is synced "on CUDA"
    torch.zeros = made_on_host(torch.zeros)  # Megatron-Core's schedules put a token counter on "cuda"
    torch.ones = made_on_host(torch.ones)  # the local attention its causal and sliding-window masks
    # Megatron-Core's optimizer makes its scale and found-inf flags on "cuda"; RoPE under context parallelism pins
    # its chunk indices
    torch.tensor = made_on_host(unpinned(torch.tensor))
    all_to_all_single = dist.all_to_all_single

    def lists(splits):
        return splits.tolist() if hasattr(splits, "tolist") else splits

    def all_to_all_with_list_splits(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
        return all_to_all_single(output, input, lists(output_split_sizes), lists(input_split_sizes), **kwargs)

    dist.all_to_all_single = all_to_all_with_list_splits
    dist.all_gather = uneven_all_gather(dist.all_gather)
    install_recompute_without_te()


def install_recompute_without_te() -> None:
    """Transformer Engine's fp8 state where ``CheckpointWithoutOutput`` reads it. Megatron-Core 0.19 sets its ``fp8``
    to ``fp8 is not None``, true even for ``fp8=False``, so a recomputed norm (``recompute_modules=['layernorm']``)
    asks Transformer Engine for the fp8 state on every build: with fp8 off it answers "disabled", as here."""
    from megatron.core.tensor_parallel import random

    if random.HAVE_TE:
        return
    random.FP8GlobalStateManager = SimpleNamespace(is_fp8_enabled=lambda: False, get_fp8_recipe=lambda: None)
    random.activation_recompute_forward = lambda **kwargs: contextlib.nullcontext()
    random.fp8_autocast = lambda **kwargs: contextlib.nullcontext()


UNEVEN_GATHERS = [0]  # how many gathers took the padded path in this process (tests check it ran)


def uneven_all_gather(all_gather):
    """gloo's ``all_gather`` that also takes outputs of different lengths along the first dimension (Megatron-Core's
    ``_gather_along_first_dim`` with ``output_split_sizes``): each part is padded to the longest and cut back."""

    def gather(tensor_list, tensor, group=None, async_op=False):
        if len({t.shape for t in tensor_list}) == 1:
            return all_gather(tensor_list, tensor, group=group, async_op=async_op)
        assert not async_op, "the uneven gather runs synchronously"
        UNEVEN_GATHERS[0] += 1
        longest = max(t.shape[0] for t in tensor_list)
        padded = tensor.new_zeros((longest, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in tensor_list]
        all_gather(parts, padded, group=group)
        for out, part in zip(tensor_list, parts):
            out.copy_(part[: out.shape[0]])
        return None

    return gather


def made_on_host(make):
    """``make`` (``torch.zeros``, ``torch.tensor``, ...) with ``device="cuda"`` taken as the host."""

    def on_host(*args, device=None, **kwargs):
        return make(*args, device="cpu" if device == "cuda" else device, **kwargs)

    return on_host


def unpinned(make):
    """``make`` with ``pin_memory`` dropped (pinning needs a CUDA driver)."""

    def host(*args, pin_memory=False, **kwargs):
        return make(*args, **kwargs)

    return host


def plain_cuda_rng() -> None:
    """Megatron-Core forks a CUDA RNG state for attention dropout, and its checkpoint (recompute) saves and restores
    the CUDA RNG state around the recompute: on CPU, a plain context and nothing to save."""
    from megatron.core.tensor_parallel import random

    random.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    random._get_cuda_rng_state = lambda *args, **kwargs: None
    random._set_cuda_rng_state = lambda *args, **kwargs: None


def init_megatron(
    expert_model_parallel_size: int,
    pipeline: int = 1,
    virtual: int | None = None,
    tensor: int = 1,
    context: int = 1,
    expert_tensor: int = 1,
) -> None:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor,
        context_parallel_size=context,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor,
        pipeline_model_parallel_size=pipeline,
        virtual_pipeline_model_parallel_size=virtual,
    )
    plain_cuda_rng()
