"""End-to-end EP-overlap smoke: a few training steps with overlap off and on; finite, bitwise-equal losses.

Run under torchrun on GPUs (NCCL):
    torchrun --nproc_per_node 2 tests/functional_tests/ep_overlap_smoke.py --device cuda
or through ``smoke(rank, world, settings)`` from the tests (gloo ranks on CPU, or on one GPU).
Every collective runs under a timeout, so a broken rank ends the run instead of hanging it.
"""

import argparse
import math
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ep_overlap_lab.engine import EPOverlapEngine
from ep_overlap_lab.moe_gpt import MoEGPTConfig, MoEGPTModel
from ep_overlap_lab.multiprocess import init_ep_groups


@dataclass(frozen=True)
class SmokeSettings:
    device: str = "cpu"
    steps: int = 3
    microbatches: int = 4
    bf16: bool = False
    timeout_s: float = 60.0


def smoke(rank: int, world: int, settings: SmokeSettings) -> dict:
    """Runs both arms on this rank; returns their losses and this rank's peak memory per arm (MB)."""
    if settings.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        torch.use_deterministic_algorithms(True)
    device = torch.device(settings.device, torch.cuda.current_device()) if settings.device == "cuda" else None
    config = MoEGPTConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        num_moe_experts=2 * world,
        moe_ffn_hidden_size=64,
        moe_router_topk=2,
        expert_model_parallel_size=world,
        seq_length=32,
        vocab_size=128,
        add_bias_linear=False,
        bf16=settings.bf16,
    )
    groups = init_ep_groups(world, timedelta(seconds=settings.timeout_s))
    out = {}
    for overlap in (False, True):
        if device is not None:
            torch.cuda.reset_peak_memory_stats(device)
        model = MoEGPTModel(config, groups, seed=11).to(device or "cpu")
        engine = EPOverlapEngine(model, groups, overlap=overlap)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        losses = []
        for step in range(settings.steps):
            gen = torch.Generator().manual_seed(step * 100 + rank)
            data = [
                tuple(t.to(device or "cpu") for t in torch.randint(0, 128, (2, 2, 32), generator=gen))
                for _ in range(settings.microbatches)
            ]
            result = engine.step(data)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(torch.stack(result.losses).sum().cpu())
        peak = torch.cuda.max_memory_allocated(device) / 2**20 if device is not None else float("nan")
        out["overlap" if overlap else "baseline"] = {"losses": torch.stack(losses), "peak_memory_mb": peak}
    return out


def check(results: dict) -> list[str]:
    """Problems found in one rank's results (empty when the smoke passed)."""
    problems = []
    base, over = results["baseline"]["losses"], results["overlap"]["losses"]
    if not (torch.isfinite(base).all() and torch.isfinite(over).all()):
        problems.append(f"non-finite loss: baseline {base.tolist()}, overlap {over.tolist()}")
    if not torch.equal(base.view(torch.int32), over.view(torch.int32)):
        problems.append(f"losses differ: baseline {base.tolist()}, overlap {over.tolist()}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    results = smoke(rank, world, SmokeSettings(device=args.device, steps=args.steps))
    problems = check(results)
    for arm, data in results.items():
        peak = data["peak_memory_mb"]
        peak_text = "n/a on CPU" if math.isnan(peak) else f"{peak:.1f} MB"
        print(f"rank {rank} {arm}: losses {[round(x, 5) for x in data['losses'].tolist()]}, peak memory {peak_text}")
    failed = torch.tensor([len(problems)])
    dist.all_reduce(failed)
    dist.destroy_process_group()
    for problem in problems:
        print(f"rank {rank}: {problem}", file=sys.stderr)
    if rank == 0:
        print("SMOKE PASSED" if failed.item() == 0 else "SMOKE FAILED")
    return 0 if failed.item() == 0 else 1


if __name__ == "__main__":
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    sys.exit(main())
