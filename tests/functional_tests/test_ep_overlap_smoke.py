"""The end-to-end smoke: always on 2 CPU ranks; on GPUs when this host has them."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ep_overlap_lab.multiprocess import run_local_ranks

from .ep_overlap_smoke import SmokeSettings, check, smoke

SCRIPT = Path(__file__).with_name("ep_overlap_smoke.py")


@pytest.mark.parametrize("bf16", [False, True])
def test_smoke_two_cpu_ranks(bf16):
    outcomes = run_local_ranks(smoke, 2, (SmokeSettings(bf16=bf16),))
    for outcome in outcomes:
        assert check(outcome.result) == []
        assert len(outcome.result["overlap"]["losses"]) == 3


@pytest.mark.gpu
def test_smoke_torchrun_on_two_gpus():
    gpus = torch.cuda.device_count()
    if gpus < 2:
        pytest.skip(f"the multi-GPU smoke needs 2+ GPUs; this host has {gpus}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(SCRIPT), "--device", "cuda"]
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SMOKE PASSED" in run.stdout


@pytest.mark.gpu
def test_smoke_two_gloo_ranks_on_one_gpu():
    # One GPU cannot host two NCCL ranks; gloo stages the all-to-all through host memory, while the CUDA lane
    # (comm stream, per-microbatch events) runs for real.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    outcomes = run_local_ranks(smoke, 2, (SmokeSettings(device="cuda"),), backend="gloo", start_method="spawn")
    for outcome in outcomes:
        assert check(outcome.result) == []
        assert not math.isnan(outcome.result["overlap"]["peak_memory_mb"])
