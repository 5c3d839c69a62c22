"""Full activation recompute inside the overlapped schedule: no number changes, the replay is in the program.

Each case trains the reference model with ``recompute_granularity="full"`` on every arm of ``workers.train_arms``
(plain path, overlap, delayed wgrad, edge pairing, chunks) and compares every loss, gradient, final parameter and
expert bias, bit for bit, with the plain path keeping everything.
"""

from dataclasses import replace

import pytest

from megatron.bridge.utils.multiprocess import run_local_ranks

from .test_numerics import EXPERT_BIAS, ROUTER_LOSSES_AND_SHARED, assert_bitwise, assert_same_training
from .workers import Case, train_arms


def full(method: str = "uniform", layers: int = 1) -> dict:
    return {"recompute_granularity": "full", "recompute_method": method, "recompute_num_layers": layers}


ARMS = ("plain", "overlap", "delayed", "delayed_edges", "delayed_window2")
CASES = {
    "fp32-uniform1": Case(arms=ARMS, extra=full()),
    "bf16-uniform1-router-losses-shared": Case(bf16=True, arms=ARMS, extra={**full(), **ROUTER_LOSSES_AND_SHARED}),
    "fp32-uniform2-expert-bias": Case(arms=ARMS, extra={**full("uniform", 2), **EXPERT_BIAS}),
    "fp32-block1": Case(arms=ARMS, extra=full("block", 1)),
}


def _kept(case: Case) -> Case:
    """The same case keeping every activation, plain path only."""
    extra = {k: v for k, v in case.extra.items() if not k.startswith("recompute")}
    return replace(case, arms=("plain",), extra=extra)


def _both(rank: int, world: int, case: Case) -> dict:
    return {"kept": train_arms(rank, world, _kept(case))["plain"], **train_arms(rank, world, case)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_full_recompute_changes_no_number(name):
    case = CASES[name]
    for outcome in run_local_ranks(_both, case.world, (case,)):
        runs = outcome.result
        for arm in case.arms:
            where = f"rank {outcome.rank} {arm} {name}"
            assert_same_training(runs["kept"], runs[arm], case.steps, where)
            for bias, value in runs["kept"]["biases"].items():
                assert_bitwise(value, runs[arm]["biases"][bias], f"{where} {bias}")
