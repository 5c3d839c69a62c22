"""Bridge 0.6.2's Qwen3-VL MoE (``vl_hook_worker.py``'s small model, images and text-only microbatches mixed) under the
CUDA emulation (``tests/unit_tests/training/ep_overlap/cuda_emulation.py``): the plain arm and this project's plan
through the hook, two gloo ranks, EP 2 (test-only; run by ``test_cuda_emulation.py`` in the stock-Bridge scratch
interpreter).

    python vl_emulated_worker.py TREE OUT.json [--steps N] [--plant missing-wait] [--models qwen3_vl,qwen35_vl]

Writes per rank, per model of ``--models``, ``vl_hook_worker.train_arms``'s record of both arms and what the
emulation reported while they ran (the plain arm runs on the default stream alone: whatever is reported is the
plan's), and the streams kernels ran on. ``--plant
missing-wait``: the comm stream waits for no compute before an all-to-all (to show the emulation reports it).
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def rank_main(rank: int, world: int, steps: int, plant: str, models: list[str]) -> dict:
    from tests.functional_tests import vl_hook_worker, vl_support
    from tests.unit_tests.training.ep_overlap.emulated_arms import emulate
    from tests.unit_tests.training.ep_overlap.mcore_cpu import init_megatron

    emu = emulate()
    if plant == "missing-wait":
        import torch

        from megatron.bridge.training.ep_overlap.runtime.lanes import CudaLane

        CudaLane._comm_waits_for = lambda self, layer, microbatch: torch.cuda.current_stream()
    init_megatron(world, 1, None)
    vl_support.use_local_specs()
    out = {}
    for name in models:  # each model's own errors: what was found while its two arms ran
        found = len(emu.errors)
        arms = vl_hook_worker.train_arms(name, 1, steps)
        out[name] = {"arms": arms, "errors": emu.errors[found:]}
    return out | {"streams": sorted({s for _, s, _ in emu.launched})}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tree", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--plant", default="", choices=["", "missing-wait"])
    parser.add_argument("--models", default="qwen3_vl", help="comma-separated: qwen3_vl, qwen35_vl")
    args = parser.parse_args()
    from ep_overlap_lab.multiprocess import run_local_ranks

    arguments = (args.steps, args.plant, args.models.split(","))
    outcomes = run_local_ranks(rank_main, 2, arguments, collective_timeout_s=120)
    args.out.write_text(json.dumps([o.result for o in outcomes]))


if __name__ == "__main__":
    sys.path.insert(1, str(ROOT))  # the tests' CPU stand-ins (tests/...); never src/, which the tree stands for
    main()
