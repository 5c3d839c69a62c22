"""Communication-overlap settings (TP, PP, DP and MoE expert-parallel), upstream's public surface kept.

Contract:
    * Fields are user intent; ``None`` means "auto". ``finalize()`` checks this config's own values.
    * ``setup()`` resolves every field and checks everything (the EP-overlap rules of :mod:`moe_overlap_rules` and
      model/overlap conflicts) before it writes: one :class:`CommOverlapConfigError` (an ``AssertionError``) lists
      every problem, and nothing is written. A value set explicitly on the model, optimizer or DDP config stands
      where this config says nothing (:func:`megatron.bridge.utils.config_values.is_explicitly_set`).
    * :func:`comm_overlap_violations` returns the same problems as a list, without raising or writing.
"""

import copy
import dataclasses
import importlib.util
import logging
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from packaging.version import Version

from megatron.bridge.training.comm_overlap_values import (
    DP_RESOLVED_FIELDS,
    MODEL_RESOLVED_FIELDS,
    comm_overlap_value_violations,
    explicit_values,
)
from megatron.bridge.training.ep_overlap.options import EPOverlapOptions
from megatron.bridge.training.ep_overlap.settings import defer_overlap_flag, resolve
from megatron.bridge.training.moe_overlap_rules import (
    CommOverlapConfigError,
    Violation,
    defers_mcore_checks,
    graph_modules,
)
from megatron.bridge.utils import versions
from megatron.bridge.utils.logging import is_rank0, warn_rank0
from megatron.bridge.utils.process_groups import data_parallel_size_of

__all__ = [
    "BulkOverlapCfg",
    "CommOverlapConfig",
    "CommOverlapConfigError",
    "PipelineOverlapCfg",
    "RingExchangeOverlapCfg",
    "TPOverlapCfg",
    "TransformerLayerTPOverlapCfg",
    "Violation",
    "comm_overlap_violations",
]

logger = logging.getLogger(__name__)

# Probed without importing: importing Transformer Engine initialises CUDA extensions.
HAVE_TE = importlib.util.find_spec("transformer_engine") is not None


def get_te_version() -> Version:
    """Installed Transformer Engine version; 0.0.0 without Transformer Engine (as Megatron-Core reports it)."""
    return versions.te_version() or Version("0.0.0")


def is_te_min_version(version: str, check_equality: bool = True) -> bool:
    """True when the installed Transformer Engine is at least (or, without equality, above) ``version``."""
    installed = versions.te_version()
    if installed is None:
        return False
    return installed >= Version(version) if check_equality else installed > Version(version)


def is_torch_min_version(version: str, check_equality: bool = True) -> bool:
    """True when the installed PyTorch is at least (or, without equality, above) ``version``."""
    installed = versions.torch_version()
    if installed is None:
        return False
    return installed >= Version(version) if check_equality else installed > Version(version)


try:  # Megatron-Bridge's own helper where the full package is installed; the same test otherwise.
    from megatron.bridge.utils.cuda_graph import has_cuda_graph_module
except ImportError:

    def has_cuda_graph_module(config: Any, module: Any) -> bool:
        """True when ``module`` is among the config's per-layer CUDA-graph modules (new or legacy field)."""
        return getattr(module, "name", module) in graph_modules(config)


@dataclass
class TPOverlapCfg:
    """Dataclass for linear layer TP overlap config."""

    pass


@dataclass
class PipelineOverlapCfg(TPOverlapCfg):
    """Dataclass for pipeline TP overlap config."""

    num_sm: int
    cga_size: int
    num_splits: int
    set_sm_margin: bool
    fp8_buf: bool = (False,)
    atomic_gemm: bool = False
    method: str = "pipeline"


@dataclass
class RingExchangeOverlapCfg(TPOverlapCfg):
    """Dataclass for ring exchange TP overlap config."""

    aggregate: bool = False
    method: str = "ring_exchange"
    num_sm: int = 1
    cga_size: int = 1
    set_sm_margin: bool = False
    fp8_buf: bool = False
    atomic_gemm: bool = False


@dataclass
class BulkOverlapCfg(TPOverlapCfg):
    """Dataclass for bulk TP overlap config."""

    num_sm: int
    cga_size: int
    set_sm_margin: bool
    method: str = "bulk"


@dataclass
class TransformerLayerTPOverlapCfg:
    """Dataclass for transformer layer TP overlap config."""

    qkv_dgrad: TPOverlapCfg
    qkv_wgrad: TPOverlapCfg
    fc1_dgrad: TPOverlapCfg
    fc1_wgrad: TPOverlapCfg
    qkv_fprop: TPOverlapCfg
    proj_dgrad: TPOverlapCfg
    fc1_fprop: TPOverlapCfg
    fc2_dgrad: TPOverlapCfg
    proj_fprop: TPOverlapCfg
    fc2_fprop: TPOverlapCfg


# TODO: Add more configs and create a getter function for expose a single api
# Model configs: H100/70B/TP8/MBS1/SeqLen8K
userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192 = TransformerLayerTPOverlapCfg(
    qkv_dgrad=BulkOverlapCfg(num_sm=4, cga_size=2, set_sm_margin=False),
    qkv_wgrad=BulkOverlapCfg(num_sm=24, cga_size=2, set_sm_margin=False),
    fc1_dgrad=BulkOverlapCfg(num_sm=2, cga_size=2, set_sm_margin=False),
    fc1_wgrad=BulkOverlapCfg(num_sm=4, cga_size=2, set_sm_margin=False),
    qkv_fprop=RingExchangeOverlapCfg(aggregate=False),
    proj_dgrad=RingExchangeOverlapCfg(aggregate=False),
    fc1_fprop=RingExchangeOverlapCfg(aggregate=False),
    fc2_dgrad=RingExchangeOverlapCfg(aggregate=False),
    proj_fprop=PipelineOverlapCfg(num_sm=24, cga_size=2, num_splits=4, set_sm_margin=True),
    fc2_fprop=PipelineOverlapCfg(num_sm=16, cga_size=2, num_splits=4, set_sm_margin=True),
)

userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192 = TransformerLayerTPOverlapCfg(
    qkv_dgrad=BulkOverlapCfg(num_sm=4, cga_size=2, set_sm_margin=False),
    qkv_wgrad=BulkOverlapCfg(num_sm=24, cga_size=2, set_sm_margin=False),
    fc1_dgrad=BulkOverlapCfg(num_sm=2, cga_size=2, set_sm_margin=False),
    fc1_wgrad=BulkOverlapCfg(num_sm=4, cga_size=2, set_sm_margin=False),
    qkv_fprop=RingExchangeOverlapCfg(aggregate=False),
    proj_dgrad=RingExchangeOverlapCfg(aggregate=False),
    fc1_fprop=RingExchangeOverlapCfg(aggregate=False),
    fc2_dgrad=RingExchangeOverlapCfg(aggregate=False),
    proj_fprop=RingExchangeOverlapCfg(num_sm=1, set_sm_margin=True),
    fc2_fprop=RingExchangeOverlapCfg(num_sm=1, set_sm_margin=True),
)

userbuffers_bf16_b200_h8192_tp2_mbs1_seqlen8192 = TransformerLayerTPOverlapCfg(
    qkv_dgrad=BulkOverlapCfg(num_sm=16, cga_size=2, set_sm_margin=False),
    qkv_wgrad=BulkOverlapCfg(num_sm=24, cga_size=2, set_sm_margin=False),
    fc1_dgrad=BulkOverlapCfg(num_sm=2, cga_size=2, set_sm_margin=False),
    fc1_wgrad=BulkOverlapCfg(num_sm=4, cga_size=2, set_sm_margin=False),
    qkv_fprop=RingExchangeOverlapCfg(aggregate=False),
    proj_dgrad=RingExchangeOverlapCfg(aggregate=False),
    fc1_fprop=RingExchangeOverlapCfg(aggregate=False),
    fc2_dgrad=RingExchangeOverlapCfg(aggregate=False),
    proj_fprop=PipelineOverlapCfg(num_sm=32, cga_size=2, num_splits=4, set_sm_margin=True),
    fc2_fprop=PipelineOverlapCfg(num_sm=16, cga_size=2, num_splits=4, set_sm_margin=True),
)

userbuffers_fp8_b200_h8192_tp2_mbs1_seqlen8192 = TransformerLayerTPOverlapCfg(
    qkv_dgrad=BulkOverlapCfg(num_sm=4, cga_size=2, set_sm_margin=False),
    qkv_wgrad=BulkOverlapCfg(num_sm=24, cga_size=2, set_sm_margin=False),
    fc1_dgrad=BulkOverlapCfg(num_sm=2, cga_size=2, set_sm_margin=False),
    fc1_wgrad=BulkOverlapCfg(num_sm=4, cga_size=2, set_sm_margin=False),
    qkv_fprop=RingExchangeOverlapCfg(aggregate=False),
    proj_dgrad=RingExchangeOverlapCfg(aggregate=False),
    fc1_fprop=RingExchangeOverlapCfg(aggregate=False),
    fc2_dgrad=RingExchangeOverlapCfg(aggregate=False),
    proj_fprop=RingExchangeOverlapCfg(num_sm=1, set_sm_margin=True),
    fc2_fprop=RingExchangeOverlapCfg(num_sm=1, set_sm_margin=True),
)

# llama3.1 405b
userbuffers_bf16_h100_h16384_tp8_cp2_mbs1_seqlen8192 = TransformerLayerTPOverlapCfg(
    qkv_dgrad=BulkOverlapCfg(num_sm=2, cga_size=2, set_sm_margin=False),
    qkv_wgrad=BulkOverlapCfg(num_sm=24, cga_size=2, set_sm_margin=False),
    fc1_dgrad=BulkOverlapCfg(num_sm=2, cga_size=2, set_sm_margin=False),
    fc1_wgrad=BulkOverlapCfg(num_sm=2, cga_size=2, set_sm_margin=False),
    qkv_fprop=RingExchangeOverlapCfg(aggregate=False),
    proj_dgrad=RingExchangeOverlapCfg(aggregate=False),
    fc1_fprop=RingExchangeOverlapCfg(aggregate=False),
    fc2_dgrad=RingExchangeOverlapCfg(aggregate=False),
    proj_fprop=PipelineOverlapCfg(num_sm=24, cga_size=2, num_splits=4, set_sm_margin=True),
    fc2_fprop=PipelineOverlapCfg(num_sm=8, cga_size=2, num_splits=4, set_sm_margin=True),
)

userbuffers_fp8_h100_h16384_tp8_cp2_mbs1_seqlen8192 = TransformerLayerTPOverlapCfg(
    qkv_dgrad=BulkOverlapCfg(num_sm=2, cga_size=2, set_sm_margin=False),
    qkv_wgrad=BulkOverlapCfg(num_sm=24, cga_size=2, set_sm_margin=False),
    fc1_dgrad=BulkOverlapCfg(num_sm=2, cga_size=2, set_sm_margin=False),
    fc1_wgrad=BulkOverlapCfg(num_sm=2, cga_size=2, set_sm_margin=False),
    qkv_fprop=RingExchangeOverlapCfg(aggregate=False),
    proj_dgrad=RingExchangeOverlapCfg(aggregate=False),
    fc1_fprop=RingExchangeOverlapCfg(aggregate=False),
    fc2_dgrad=RingExchangeOverlapCfg(aggregate=False),
    proj_fprop=RingExchangeOverlapCfg(num_sm=1, set_sm_margin=True),
    fc2_fprop=RingExchangeOverlapCfg(num_sm=1, set_sm_margin=True),
)

userbuffers_bf16_b200_h16384_tp4_cp2_mbs1_seqlen8192 = TransformerLayerTPOverlapCfg(
    qkv_dgrad=BulkOverlapCfg(num_sm=8, cga_size=2, set_sm_margin=False),
    qkv_wgrad=BulkOverlapCfg(num_sm=24, cga_size=2, set_sm_margin=False),
    fc1_dgrad=BulkOverlapCfg(num_sm=2, cga_size=2, set_sm_margin=False),
    fc1_wgrad=BulkOverlapCfg(num_sm=2, cga_size=2, set_sm_margin=False),
    qkv_fprop=RingExchangeOverlapCfg(aggregate=False),
    proj_dgrad=RingExchangeOverlapCfg(aggregate=False),
    fc1_fprop=RingExchangeOverlapCfg(aggregate=False),
    fc2_dgrad=RingExchangeOverlapCfg(aggregate=False),
    proj_fprop=PipelineOverlapCfg(num_sm=32, cga_size=2, num_splits=4, set_sm_margin=True),
    fc2_fprop=PipelineOverlapCfg(num_sm=8, cga_size=2, num_splits=4, set_sm_margin=True),
)

userbuffers_fp8_b200_h16384_tp4_cp2_mbs1_seqlen8192 = TransformerLayerTPOverlapCfg(
    qkv_dgrad=BulkOverlapCfg(num_sm=8, cga_size=2, set_sm_margin=False),
    qkv_wgrad=BulkOverlapCfg(num_sm=32, cga_size=2, set_sm_margin=False),
    fc1_dgrad=BulkOverlapCfg(num_sm=2, cga_size=2, set_sm_margin=False),
    fc1_wgrad=BulkOverlapCfg(num_sm=8, cga_size=2, set_sm_margin=False),
    qkv_fprop=RingExchangeOverlapCfg(aggregate=False),
    proj_dgrad=RingExchangeOverlapCfg(aggregate=False),
    fc1_fprop=RingExchangeOverlapCfg(aggregate=False),
    fc2_dgrad=RingExchangeOverlapCfg(aggregate=False),
    proj_fprop=RingExchangeOverlapCfg(num_sm=1, set_sm_margin=True),
    fc2_fprop=RingExchangeOverlapCfg(num_sm=1, set_sm_margin=True),
)

# llama3 70b LoRA
userbuffers_fp8_h100_h8192_tp2_mbs1_seqlen4096_lora = TransformerLayerTPOverlapCfg(
    qkv_dgrad=BulkOverlapCfg(num_sm=2, cga_size=2, set_sm_margin=False),
    qkv_wgrad=None,
    fc1_dgrad=PipelineOverlapCfg(num_sm=16, cga_size=2, num_splits=4, set_sm_margin=True, fp8_buf=True),
    fc1_wgrad=None,
    qkv_fprop=RingExchangeOverlapCfg(set_sm_margin=True),
    proj_dgrad=RingExchangeOverlapCfg(set_sm_margin=True),
    fc1_fprop=RingExchangeOverlapCfg(set_sm_margin=True),
    fc2_dgrad=RingExchangeOverlapCfg(set_sm_margin=True),
    proj_fprop=RingExchangeOverlapCfg(cga_size=2, set_sm_margin=True, fp8_buf=True),
    fc2_fprop=RingExchangeOverlapCfg(cga_size=2, set_sm_margin=True, fp8_buf=True),
)

# llama3.1 405b LoRA
userbuffers_fp8_h100_h16384_tp4_mbs1_seqlen2048_lora = TransformerLayerTPOverlapCfg(
    qkv_dgrad=BulkOverlapCfg(num_sm=2, cga_size=2, set_sm_margin=False),
    qkv_wgrad=None,
    fc1_dgrad=PipelineOverlapCfg(num_sm=16, cga_size=2, num_splits=4, set_sm_margin=True, fp8_buf=True),
    fc1_wgrad=None,
    qkv_fprop=RingExchangeOverlapCfg(aggregate=True),
    proj_dgrad=RingExchangeOverlapCfg(aggregate=True),
    fc1_fprop=RingExchangeOverlapCfg(aggregate=True),
    fc2_dgrad=RingExchangeOverlapCfg(aggregate=True),
    proj_fprop=PipelineOverlapCfg(num_sm=32, cga_size=2, num_splits=4, set_sm_margin=True, fp8_buf=True),
    fc2_fprop=PipelineOverlapCfg(num_sm=16, cga_size=2, num_splits=4, set_sm_margin=True, fp8_buf=True),
)

# GPT3 20b
userbuffers_bf16_h100_h6144_tp2_mbs2_seqlen2048 = TransformerLayerTPOverlapCfg(
    qkv_dgrad=BulkOverlapCfg(num_sm=8, cga_size=2, set_sm_margin=False),
    qkv_wgrad=BulkOverlapCfg(num_sm=16, cga_size=2, set_sm_margin=False),
    fc1_dgrad=BulkOverlapCfg(num_sm=4, cga_size=2, set_sm_margin=False),
    fc1_wgrad=BulkOverlapCfg(num_sm=16, cga_size=2, set_sm_margin=False),
    qkv_fprop=RingExchangeOverlapCfg(aggregate=False),
    proj_dgrad=RingExchangeOverlapCfg(aggregate=False),
    fc1_fprop=RingExchangeOverlapCfg(aggregate=False),
    fc2_dgrad=RingExchangeOverlapCfg(aggregate=False),
    proj_fprop=PipelineOverlapCfg(num_sm=16, cga_size=2, num_splits=4, set_sm_margin=True),
    fc2_fprop=PipelineOverlapCfg(num_sm=24, cga_size=2, num_splits=4, set_sm_margin=True),
)

userbuffers_fp8_h100_h6144_tp2_mbs2_seqlen2048 = TransformerLayerTPOverlapCfg(
    qkv_dgrad=BulkOverlapCfg(num_sm=8, cga_size=2, set_sm_margin=False),
    qkv_wgrad=BulkOverlapCfg(num_sm=16, cga_size=2, set_sm_margin=False),
    fc1_dgrad=BulkOverlapCfg(num_sm=4, cga_size=2, set_sm_margin=False),
    fc1_wgrad=BulkOverlapCfg(num_sm=16, cga_size=2, set_sm_margin=False),
    qkv_fprop=RingExchangeOverlapCfg(aggregate=False),
    proj_dgrad=RingExchangeOverlapCfg(aggregate=False),
    fc1_fprop=RingExchangeOverlapCfg(aggregate=False),
    fc2_dgrad=RingExchangeOverlapCfg(aggregate=False),
    proj_fprop=PipelineOverlapCfg(num_sm=16, cga_size=2, num_splits=4, set_sm_margin=True, fp8_buf=True),
    fc2_fprop=PipelineOverlapCfg(num_sm=24, cga_size=2, num_splits=4, set_sm_margin=True, fp8_buf=True),
)

# GPT3 175b
userbuffers_bf16_h100_h12288_tp4_mbs1_seqlen2048 = TransformerLayerTPOverlapCfg(
    qkv_dgrad=BulkOverlapCfg(num_sm=4, cga_size=2, set_sm_margin=False),
    qkv_wgrad=BulkOverlapCfg(num_sm=4, cga_size=2, set_sm_margin=False),
    fc1_dgrad=BulkOverlapCfg(num_sm=2, cga_size=2, set_sm_margin=False),
    fc1_wgrad=BulkOverlapCfg(num_sm=4, cga_size=2, set_sm_margin=False),
    qkv_fprop=RingExchangeOverlapCfg(aggregate=False),
    proj_dgrad=RingExchangeOverlapCfg(aggregate=False),
    fc1_fprop=RingExchangeOverlapCfg(aggregate=False),
    fc2_dgrad=RingExchangeOverlapCfg(aggregate=False),
    proj_fprop=PipelineOverlapCfg(num_sm=24, cga_size=2, num_splits=4, set_sm_margin=True),
    fc2_fprop=RingExchangeOverlapCfg(num_sm=1, set_sm_margin=True),
)

userbuffers_fp8_h100_h12288_tp4_mbs1_seqlen2048 = TransformerLayerTPOverlapCfg(
    qkv_dgrad=BulkOverlapCfg(num_sm=4, cga_size=2, set_sm_margin=False),
    qkv_wgrad=BulkOverlapCfg(num_sm=4, cga_size=2, set_sm_margin=False),
    fc1_dgrad=BulkOverlapCfg(num_sm=2, cga_size=2, set_sm_margin=False),
    fc1_wgrad=BulkOverlapCfg(num_sm=4, cga_size=2, set_sm_margin=False),
    qkv_fprop=RingExchangeOverlapCfg(aggregate=False),
    proj_dgrad=RingExchangeOverlapCfg(aggregate=False),
    fc1_fprop=RingExchangeOverlapCfg(aggregate=False),
    fc2_dgrad=RingExchangeOverlapCfg(aggregate=False),
    proj_fprop=RingExchangeOverlapCfg(num_sm=1, set_sm_margin=True),
    fc2_fprop=RingExchangeOverlapCfg(num_sm=1, set_sm_margin=True),
)

userbuffers_bf16_b200_h12288_tp4_mbs1_seqlen2048 = TransformerLayerTPOverlapCfg(
    qkv_dgrad=BulkOverlapCfg(num_sm=4, cga_size=2, set_sm_margin=False),
    qkv_wgrad=BulkOverlapCfg(num_sm=16, cga_size=2, set_sm_margin=False),
    fc1_dgrad=BulkOverlapCfg(num_sm=2, cga_size=2, set_sm_margin=False),
    fc1_wgrad=BulkOverlapCfg(num_sm=8, cga_size=2, set_sm_margin=False),
    qkv_fprop=RingExchangeOverlapCfg(aggregate=False),
    proj_dgrad=RingExchangeOverlapCfg(aggregate=False),
    fc1_fprop=RingExchangeOverlapCfg(aggregate=False),
    fc2_dgrad=RingExchangeOverlapCfg(aggregate=False),
    proj_fprop=RingExchangeOverlapCfg(num_sm=1, set_sm_margin=True),
    fc2_fprop=RingExchangeOverlapCfg(num_sm=1, set_sm_margin=True),
)

userbuffers_fp8_b200_h12288_tp4_mbs1_seqlen2048 = TransformerLayerTPOverlapCfg(
    qkv_dgrad=BulkOverlapCfg(num_sm=4, cga_size=2, set_sm_margin=False),
    qkv_wgrad=BulkOverlapCfg(num_sm=16, cga_size=2, set_sm_margin=False),
    fc1_dgrad=BulkOverlapCfg(num_sm=2, cga_size=2, set_sm_margin=False),
    fc1_wgrad=BulkOverlapCfg(num_sm=8, cga_size=2, set_sm_margin=False),
    qkv_fprop=RingExchangeOverlapCfg(aggregate=False),
    proj_dgrad=RingExchangeOverlapCfg(aggregate=False),
    fc1_fprop=RingExchangeOverlapCfg(aggregate=False),
    fc2_dgrad=RingExchangeOverlapCfg(aggregate=False),
    proj_fprop=RingExchangeOverlapCfg(num_sm=1, set_sm_margin=True),
    fc2_fprop=RingExchangeOverlapCfg(num_sm=1, set_sm_margin=True),
)

# Nemotron 15B
userbuffers_bf16_b200_h6144_tp2_mbs1_seqlen4096 = TransformerLayerTPOverlapCfg(
    qkv_dgrad=BulkOverlapCfg(num_sm=8, cga_size=2, set_sm_margin=False),
    qkv_wgrad=BulkOverlapCfg(num_sm=32, cga_size=2, set_sm_margin=False),
    fc1_dgrad=BulkOverlapCfg(num_sm=2, cga_size=2, set_sm_margin=False),
    fc1_wgrad=BulkOverlapCfg(num_sm=8, cga_size=2, set_sm_margin=False),
    qkv_fprop=RingExchangeOverlapCfg(aggregate=False),
    proj_dgrad=RingExchangeOverlapCfg(aggregate=False),
    fc1_fprop=RingExchangeOverlapCfg(aggregate=False),
    fc2_dgrad=RingExchangeOverlapCfg(aggregate=False),
    proj_fprop=RingExchangeOverlapCfg(num_sm=1, set_sm_margin=True),
    fc2_fprop=RingExchangeOverlapCfg(num_sm=1, set_sm_margin=True),
)

# Nemotron 340B
userbuffers_bf16_b200_h18432_tp8_mbs1_seqlen4096 = TransformerLayerTPOverlapCfg(
    qkv_dgrad=BulkOverlapCfg(num_sm=8, cga_size=2, set_sm_margin=False),
    qkv_wgrad=BulkOverlapCfg(num_sm=32, cga_size=2, set_sm_margin=False),
    fc1_dgrad=BulkOverlapCfg(num_sm=2, cga_size=2, set_sm_margin=False),
    fc1_wgrad=BulkOverlapCfg(num_sm=8, cga_size=2, set_sm_margin=False),
    qkv_fprop=RingExchangeOverlapCfg(aggregate=False),
    proj_dgrad=RingExchangeOverlapCfg(aggregate=False),
    fc1_fprop=RingExchangeOverlapCfg(aggregate=False),
    fc2_dgrad=RingExchangeOverlapCfg(aggregate=False),
    proj_fprop=RingExchangeOverlapCfg(num_sm=1, set_sm_margin=True),
    fc2_fprop=PipelineOverlapCfg(num_sm=24, cga_size=2, num_splits=4, set_sm_margin=True),
)

userbuffers_fp8_b200_h18432_tp8_mbs1_seqlen4096 = TransformerLayerTPOverlapCfg(
    qkv_dgrad=BulkOverlapCfg(num_sm=8, cga_size=2, set_sm_margin=False),
    qkv_wgrad=BulkOverlapCfg(num_sm=32, cga_size=2, set_sm_margin=False),
    fc1_dgrad=BulkOverlapCfg(num_sm=2, cga_size=2, set_sm_margin=False),
    fc1_wgrad=BulkOverlapCfg(num_sm=8, cga_size=2, set_sm_margin=False),
    qkv_fprop=RingExchangeOverlapCfg(aggregate=False),
    proj_dgrad=RingExchangeOverlapCfg(aggregate=False),
    fc1_fprop=RingExchangeOverlapCfg(aggregate=False),
    fc2_dgrad=RingExchangeOverlapCfg(aggregate=False),
    proj_fprop=RingExchangeOverlapCfg(num_sm=1, set_sm_margin=True),
    fc2_fprop=RingExchangeOverlapCfg(num_sm=1, set_sm_margin=True),
)


@dataclass
class _CommOverlapConfig:
    # Tensor parallel communication overlap (experimental)
    tp_comm_overlap: bool = None
    tp_comm_overlap_cfg: dict = None
    tp_comm_bootstrap_backend: str = None
    # Pipeline parallel communication overlap
    overlap_p2p_comm: bool = None
    batch_p2p_comm: bool = None
    # Data parallel communication overlap
    overlap_grad_reduce: bool = None
    overlap_param_gather: bool = None
    overlap_param_gather_with_optimizer_step: bool = None
    align_param_gather: bool = None
    bucket_size: int = None
    # Pipeline bubble overlap
    defer_embedding_wgrad_compute: bool = None
    wgrad_deferral_limit: int = None
    # MOE expert parallel comm
    overlap_moe_expert_parallel_comm: bool = None
    delay_wgrad_compute: bool = None


_DP_BUCKET_SIZE = 128 * 1024 * 1024


@dataclass(kw_only=True)
class CommOverlapConfig:
    """Which communications to overlap with compute. ``None`` means "auto".

    This class enforces the EP-overlap rules itself (``checks_ep_overlap_rules``), so the plugin entry point
    ``EPOverlapCommOverlapConfig`` defers to it.

    Attributes:
        tp_comm_overlap: Tensor-parallel comm overlap (Transformer Engine userbuffers). Required.
        tp_comm_overlap_cfg: Per-GEMM TP overlap settings (a ``TransformerLayerTPOverlapCfg``, another dataclass,
            or a dict), used when TP overlap is on. None lets Transformer Engine use its defaults.
        tp_comm_bootstrap_backend: Backend used to bootstrap TP userbuffers: "nccl", "mpi" or "gloo".
        overlap_p2p_comm: Overlap pipeline send/recv with compute (auto: on with PP > 1 and VPP).
        batch_p2p_comm: Batch pipeline send/recv (auto: on with PP > 1 without VPP).
        overlap_grad_reduce: Overlap DP gradient reduce-scatter (auto: on with DP > 1 and distributed optimizer).
        overlap_param_gather: Overlap DP parameter all-gather (auto: as overlap_grad_reduce).
        overlap_param_gather_with_optimizer_step: Overlap param all-gather with the optimizer step (auto: off).
        align_param_gather: Align param all-gathers across virtual stages (auto: on with DP > 1, PP > 1 and VPP).
        bucket_size: DP bucket size in elements (auto: 128 Mi with DP > 1 and distributed optimizer).
        defer_embedding_wgrad_compute: Defer the embedding wgrad into the pipeline bubble (auto: off).
        wgrad_deferral_limit: Number of microbatches the embedding wgrad may be deferred (auto: -1, no limit).
        data_parallel_size: DP size (auto: world size / (TP * PP * CP) when a process group exists, else 1).
        overlap_moe_expert_parallel_comm: Hide MoE expert-parallel all-to-all behind the other microbatch's
            compute (1F1B-interleaved layer schedule). Auto keeps the model config's value, else off.
        delay_wgrad_compute: Compute expert weight gradients under the dispatch-backward all-to-all.
            Needs overlap_moe_expert_parallel_comm. Auto keeps the model config's value, else off.
    """

    tp_comm_overlap: bool
    tp_comm_overlap_cfg: TransformerLayerTPOverlapCfg | Any | None = None
    tp_comm_bootstrap_backend: str | None = "nccl"
    overlap_p2p_comm: bool | None = None
    batch_p2p_comm: bool | None = None
    overlap_grad_reduce: bool | None = None
    overlap_param_gather: bool | None = None
    overlap_param_gather_with_optimizer_step: bool | None = None
    align_param_gather: bool | None = None
    bucket_size: int | None = None
    defer_embedding_wgrad_compute: bool | None = None
    wgrad_deferral_limit: int | None = None
    data_parallel_size: int | None = None
    overlap_moe_expert_parallel_comm: bool | None = None
    delay_wgrad_compute: bool | None = None

    checks_ep_overlap_rules = True  # a class attribute, not a field

    def finalize(self) -> None:
        """Checks this config's own values and records them as the user's request (``user_comm_overlap_cfg``).

        Raises:
            CommOverlapConfigError: Listing every field of the wrong type or out of range.
        """
        problems = self._own_violations()
        if problems:
            raise CommOverlapConfigError(problems)
        # A re-run of finalize keeps the request recorded first (setup may have narrowed it, e.g. TP off).
        if getattr(self, "user_comm_overlap_cfg", None) is not None:
            return
        self.user_comm_overlap_cfg = _CommOverlapConfig(
            **{f.name: getattr(self, f.name) for f in fields(_CommOverlapConfig)}
        )

    def setup(self, model_config: Any, optimizer_config: Any = None, ddp_config: Any = None) -> None:
        """Resolves every field, validates, then writes the values into the given configs.

        Args:
            model_config: The model config (a Megatron-Core ``TransformerConfig``, a Bridge model provider or
                ``GPTModelConfig``, or any object with the same attribute names).
            optimizer_config: Optional optimizer config; receives DP overlap values with a distributed optimizer.
            ddp_config: Optional DDP config; receives DP overlap values with a distributed optimizer.

        Raises:
            CommOverlapConfigError: One error listing every violated rule and every model/overlap conflict.
        """
        plan, problems = self._plan(model_config, optimizer_config, ddp_config)
        if problems:
            raise CommOverlapConfigError(problems)
        for resolved, target in plan:
            self._apply_cfgs(resolved, target)
        defer_overlap_flag(model_config)
        if getattr(model_config, "tp_comm_overlap", False):
            model_config.tp_comm_overlap_cfg = self._tp_overlap_dict(plan[0][0].tp_comm_overlap_cfg)
            model_config.tp_comm_bootstrap_backend = plan[0][0].tp_comm_bootstrap_backend
        self._set_cuda_device_max_connections(model_config)

    # --------------------------------------------------------------------------------------------------------
    # Megatron-Bridge's resolution steps (upstream code calls and tests these directly)

    def _get_model_comm_overlap_cfgs(self, model_cfg: Any, ddp_config: Any) -> _CommOverlapConfig:
        """Resolved values for the model config. Raises CommOverlapConfigError for every problem found."""
        resolved, problems = self._resolve_model(model_cfg, _grad_reduce_requested(self._user(), ddp_config))
        if problems:
            raise CommOverlapConfigError(problems)
        return resolved

    def _get_optimizer_overlap_cfgs(self, model_cfg: Any) -> _CommOverlapConfig:
        """Resolved data-parallel values for the optimizer and DDP configs (distributed optimizer only)."""
        dp = self.data_parallel_size or data_parallel_size_of(model_cfg)
        pp, vpp = _pipeline_sizes(model_cfg)
        cfg = _CommOverlapConfig(
            bucket_size=None,
            overlap_grad_reduce=False,
            overlap_param_gather=False,
            # Left off upstream as well: with it, checkpointing of the optimizer state misbehaves.
            overlap_param_gather_with_optimizer_step=False,
            align_param_gather=False,
        )
        if dp > 1:
            cfg.bucket_size = _DP_BUCKET_SIZE
            cfg.overlap_grad_reduce = True
            cfg.overlap_param_gather = True
            cfg.align_param_gather = pp > 1 and vpp > 1
        return self._override_user_cfgs(cfg)

    def _apply_cfgs(self, src_cfg: Any, dest_cfg: Any) -> None:
        """Copies every field of ``src_cfg`` that ``dest_cfg`` has onto it."""
        for field in fields(src_cfg):
            if hasattr(dest_cfg, field.name):
                setattr(dest_cfg, field.name, getattr(src_cfg, field.name))

    def _override_user_cfgs(self, comm_overlap_cfg: _CommOverlapConfig) -> _CommOverlapConfig:
        """Replaces values of ``comm_overlap_cfg`` with every value the user set (not None)."""
        user = getattr(self, "user_comm_overlap_cfg", None)
        if isinstance(user, _CommOverlapConfig):
            for field in fields(user):
                value = getattr(user, field.name)
                if value is not None:
                    setattr(comm_overlap_cfg, field.name, value)
        return comm_overlap_cfg

    # --------------------------------------------------------------------------------------------------------
    # Resolution with every problem collected

    def _user(self) -> _CommOverlapConfig:
        if getattr(self, "user_comm_overlap_cfg", None) is None:
            self.finalize()
        return self.user_comm_overlap_cfg

    def _plan(
        self, model_config: Any, optimizer_config: Any, ddp_config: Any
    ) -> tuple[list[tuple[_CommOverlapConfig, Any]], list[Violation]]:
        """What to write where, and every problem found; writes nothing."""
        problems = self._own_violations()
        if problems:
            return [], problems
        user = self._user()
        dp_plan: list[tuple[_CommOverlapConfig, Any]] = []
        grad_reduce = _grad_reduce_requested(user, ddp_config)
        # Data-parallel overlap needs Megatron's DDP with the distributed optimizer.
        if optimizer_config is not None and getattr(ddp_config, "use_distributed_optimizer", False):
            dp_cfg = self._get_optimizer_overlap_cfgs(model_config)
            for target in (optimizer_config, ddp_config):
                dp_plan.append((self._keep_explicit(dp_cfg, target, DP_RESOLVED_FIELDS, problems), target))
            grad_reduce = bool(dp_plan[-1][0].overlap_grad_reduce)
        model_cfg, model_problems = self._resolve_model(model_config, grad_reduce)
        return [(model_cfg, model_config), *dp_plan], model_problems + problems

    def _resolve_model(self, model_cfg: Any, overlap_grad_reduce: bool) -> tuple[_CommOverlapConfig, list[Violation]]:
        """Model-config values: defaults by layout, then explicit model values, then the user's; and the checks."""
        user = self._user()
        pp, vpp = _pipeline_sizes(model_cfg)
        cfg = _CommOverlapConfig(
            tp_comm_overlap=False,
            tp_comm_overlap_cfg=None,
            overlap_p2p_comm=pp > 1 and vpp > 1,
            batch_p2p_comm=pp > 1 and vpp == 1,
            defer_embedding_wgrad_compute=False,
            wgrad_deferral_limit=-1,
            overlap_moe_expert_parallel_comm=False,
            delay_wgrad_compute=False,
        )
        if user.tp_comm_overlap is True and not self._tp_overlap_feasible(model_cfg):
            user.tp_comm_overlap = False
        problems: list[Violation] = []
        cfg = self._keep_explicit(self._override_user_cfgs(cfg), model_cfg, MODEL_RESOLVED_FIELDS, problems)
        if cfg.overlap_moe_expert_parallel_comm and not hasattr(model_cfg, "overlap_moe_expert_parallel_comm"):
            problems.append(
                Violation(
                    "model_field",
                    {"model": type(model_cfg).__name__},
                    f"model_cfg {type(model_cfg).__name__} does not have overlap_moe_expert_parallel_comm.",
                    "use a model config derived from Megatron-Core's TransformerConfig.",
                )
            )
        options = EPOverlapOptions(overlap=cfg.overlap_moe_expert_parallel_comm, delay_wgrad=cfg.delay_wgrad_compute)
        problems += resolve(
            model_cfg,
            options,
            overlap_grad_reduce=overlap_grad_reduce,
            # Looked up at call time, so code that patches this module's version checks is honoured.
            torch_at_least=lambda minimum: is_torch_min_version(minimum),
            te_at_least=lambda minimum: is_te_min_version(minimum),
            # a Bridge model provider runs Megatron-Core's own checks after this setup
            model_config_built=not defers_mcore_checks(model_cfg),
        ).violations
        return cfg, problems

    def _keep_explicit(
        self, resolved: _CommOverlapConfig, target: Any, names: tuple[str, ...], problems: list[Violation]
    ) -> _CommOverlapConfig:
        """A copy of ``resolved`` in which values set explicitly on ``target`` stand where the user said nothing.

        A user value that disagrees with an explicit target value is recorded as a ``conflict`` problem.
        """
        kept, conflicts = explicit_values(self._user(), target, names)
        problems += conflicts
        return dataclasses.replace(resolved, **kept)

    def _tp_overlap_feasible(self, model_cfg: Any) -> bool:
        """False, with upstream's warning, where TP overlap cannot work."""
        reason = None
        if (getattr(model_cfg, "tensor_model_parallel_size", 1) or 1) < 2:
            reason = "TP size < 2"
        elif not getattr(model_cfg, "sequence_parallel", False):
            reason = "sequence_parallel=False"
        elif not HAVE_TE:
            reason = "TE not detected"
        if reason is None:
            return True
        if is_rank0():
            # The root logger, with upstream's exact wording: Bridge's tooling and tests match on it.
            logging.warning(f"Disabling tensor parallel communication overlap due to {reason}.")
        return False

    @staticmethod
    def _tp_overlap_dict(tp_cfg: Any) -> dict | None:
        """The TP overlap settings as Transformer Engine takes them: a dict without None values."""
        if tp_cfg is None:
            if is_rank0():
                logging.warning(
                    "Tensor parallel overlap: No overlap config provided. "
                    "Initializing TP comm overlap with the default config."
                )
            return None
        as_dict = asdict(tp_cfg) if dataclasses.is_dataclass(tp_cfg) else dict(tp_cfg)
        return {key: value for key, value in as_dict.items() if value is not None}

    def _own_violations(self) -> list[Violation]:
        return comm_overlap_value_violations(self)

    def _set_cuda_device_max_connections(self, model_config: Any) -> None:
        """Sets CUDA_DEVICE_MAX_CONNECTIONS as the overlap settings need it. No-op without CUDA."""
        if not torch.cuda.is_available():
            return
        tp = getattr(model_config, "tensor_model_parallel_size", 1) or 1
        cp = getattr(model_config, "context_parallel_size", 1) or 1
        if getattr(model_config, "overlap_moe_expert_parallel_comm", False):
            # The comm stream needs its own hardware queue, or the all-to-all waits behind compute kernels.
            if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
                warn_rank0(
                    logger,
                    "CUDA_DEVICE_MAX_CONNECTIONS=1 serializes the comm and compute streams and shrinks EP "
                    "overlap; unset it or set 32.",
                )
            return
        major, _ = torch.cuda.get_device_capability()
        if major <= 9 and (tp > 1 or cp > 1):
            # Keep host issue order on the GPU, so TP comm kernels start before the GEMM they overlap.
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
            logger.info("Set CUDA_DEVICE_MAX_CONNECTIONS=1")


def comm_overlap_violations(
    comm_overlap: CommOverlapConfig, model_config: Any, optimizer_config: Any = None, ddp_config: Any = None
) -> list[Violation]:
    """Every problem ``comm_overlap.setup`` would raise for these configs, as a list. Never raises or writes."""
    probe = copy.deepcopy(comm_overlap)  # resolution may narrow the recorded request (TP off); keep the user's
    return probe._plan(model_config, optimizer_config, ddp_config)[1]


def _pipeline_sizes(model_cfg: Any) -> tuple[int, int]:
    pp = getattr(model_cfg, "pipeline_model_parallel_size", 1) or 1
    vpp = getattr(model_cfg, "virtual_pipeline_model_parallel_size", None) or 1
    return pp, vpp


def _grad_reduce_requested(user: _CommOverlapConfig, ddp_config: Any) -> bool:
    """Upstream's reading of "DP grad reduce overlaps": on the DDP config, or asked for here."""
    return bool(getattr(ddp_config, "overlap_grad_reduce", False) or user.overlap_grad_reduce)
