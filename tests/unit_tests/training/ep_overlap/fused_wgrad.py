"""Test-only: Apex's ``fused_weight_gradient_mlp_cuda`` in torch, so that ``gradient_accumulation_fusion`` runs on CPU.

With the fusion, Megatron-Core's linears (and Transformer Engine's, ``fuse_wgrad_accumulation``) add each use's weight
gradient straight into ``weight.main_grad`` in their backward, where without it autograd sums a weight's uses into
``.grad`` first and the DDP hook adds the sum. The kernel computes ``grad_output^T @ input`` in fp32 and adds it to
``main_grad``; this does the same in torch. :func:`install_fused_wgrad` makes Megatron-Core's ``tensor_parallel``
layers take it, in this (forked) process only; the tests' ``DuplicatedLinear`` reads the config field itself.
"""

import types

import torch


def accumulate_wgrad(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ total_input`` (2-D ``[tokens, out]`` and ``[tokens, in]``), in fp32."""
    with torch.no_grad():  # the kernel is outside autograd (it runs in a backward, or in backward_dw)
        main_grad.add_(grad_output.t().float().matmul(total_input.float()).to(main_grad.dtype))


FUSED_WGRAD = types.SimpleNamespace(wgrad_gemm_accum_fp32=accumulate_wgrad, wgrad_gemm_accum_fp16=accumulate_wgrad)


def install_fused_wgrad() -> None:
    """Megatron-Core's linears take :data:`FUSED_WGRAD` as the kernel (call before the model is built: they check
    that the kernel imported when ``gradient_accumulation_fusion`` is set)."""
    from megatron.core.tensor_parallel import layers

    layers.fused_weight_gradient_mlp_cuda = FUSED_WGRAD
    layers._grad_accum_fusion_available = True
