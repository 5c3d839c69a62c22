"""A rank whose driver call count disagrees with the agreed count fails at that call, on every rank within seconds.

Megatron-Core's num-microbatches calculator says 4 on both EP ranks (the agreement passes: one host all-gather), and
one rank's driver runs another count, as a loop that passes its own ``num_microbatches`` may. The rank that makes the
call the count does not allow knows it there; its peer is blocked in that call's all-to-alls and reads the reason it
posted while it waits (not after the collective timeout, 30 s here).
"""

import time
from datetime import timedelta

import pytest
import torch

from .local_ranks import run_local_ranks
from .mcore_cpu import init_megatron, install_cpu_stubs
from .mcore_models import McoreCase, build_model
from .test_mcore_hook import SEQ, bridge_style_forward_step

MICRO_BATCH, AGREED = 2, 4


def run_other_count(rank: int, world: int, counts: tuple[int, int]) -> dict:
    install_cpu_stubs()
    init_megatron(world)
    from megatron.core import num_microbatches_calculator as calculator
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron.bridge.training.ep_overlap.mcore import use_ep_overlap_schedule

    calculator.init_num_microbatches_calculator(rank, None, AGREED * MICRO_BATCH, MICRO_BATCH, 1)
    model = build_model(McoreCase(microbatches=AGREED))
    model.config.overlap_moe_expert_parallel_comm = True
    use_ep_overlap_schedule([model], timeout=timedelta(seconds=30))
    count = counts[rank]
    gen = torch.Generator().manual_seed(rank)
    data = [tuple(torch.randint(0, 64, (2, MICRO_BATCH, SEQ), generator=gen)) for _ in range(count)]
    start = time.monotonic()
    try:
        get_forward_backward_func()(
            forward_step_func=bridge_style_forward_step, data_iterator=iter(data), model=[model],
            num_microbatches=count, seq_length=SEQ, micro_batch_size=MICRO_BATCH, forward_only=False,
        )  # fmt: skip
        return {"error": None}
    except RuntimeError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}


@pytest.mark.parametrize(
    "counts, named",
    [
        ((AGREED, 3), "rank 1's driver ran 3 microbatches in a step agreed at 4"),
        ((AGREED, 5), "rank 1's driver runs at least 5 microbatches (it built a plan for microbatch 4) in a step "
                      "agreed at 4"),
    ],
    ids=["fewer", "more"],
)  # fmt: skip
def test_a_driver_running_another_count_than_the_agreed_one_fails_every_rank_within_seconds(counts, named):
    # Finding 6 of issue 63: both ranks waited for the collective timeout, then blamed an all-to-all.
    for outcome in run_local_ranks(run_other_count, 2, (counts,), raise_on_error=False):
        error = outcome.result["error"] if outcome.result else outcome.error
        assert error is not None and error.startswith("MicrobatchCountsDiffer: "), error
        assert named in error and "counts from Megatron-Core's num-microbatches calculator" in error, error
        assert ("stopped with it" in error) == (outcome.rank == 0), error  # rank 0 read what rank 1 posted
        assert outcome.result["seconds"] < 10, outcome.result
