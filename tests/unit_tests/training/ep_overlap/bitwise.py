"""Bit-for-bit comparisons of tensors and of training runs: bit patterns, so -0.0 vs 0.0 or a NaN counts as a
difference."""

import pytest
import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    if not torch.equal(bits(a), bits(b)):
        diff = (a.double() - b.double()).abs().max().item()
        pytest.fail(f"{what} differs (max abs diff {diff:g})")


def assert_same_training(expected: dict, got: dict, steps: int, where: str) -> None:
    """Two runs' per-step losses and gradients and final parameters (``train_arms``' arm dicts), bit for bit."""
    for step in range(steps):
        assert_bitwise(expected["losses"][step], got["losses"][step], f"{where} step {step} losses")
        for param, grad in expected["grads"][step].items():
            assert_bitwise(grad, got["grads"][step][param], f"{where} step {step} grad {param}")
    for param, value in expected["params"].items():
        assert_bitwise(value, got["params"][param], f"{where} final {param}")


def assert_steps_bitwise(plain: dict, overlap: dict, steps: int, rank: int) -> None:
    """Two arms' per-step losses (None off the last pipeline stage, in both) and gradients (the same parameters, at
    least one), bit for bit."""
    for step in range(steps):
        where = f"rank {rank} step {step}"
        if plain["losses"][step] is None:
            assert overlap["losses"][step] is None, where
        else:
            assert_bitwise(plain["losses"][step], overlap["losses"][step], f"{where} losses")
        assert plain["grads"][step].keys() == overlap["grads"][step].keys() and plain["grads"][step], where
        for param, grad in plain["grads"][step].items():
            assert_bitwise(grad, overlap["grads"][step][param], f"{where} {param}")


def assert_arms_match_plain(result: dict, rank: int, arms=("mcore", "hook")) -> None:
    """``result["plain"]``'s losses (per step) and gradients (by parameter), bit for bit in each of ``arms``."""
    plain = result["plain"]
    for arm in arms:
        got = result[arm]
        for step, (want, have) in enumerate(zip(plain["losses"], got["losses"])):
            assert_bitwise(want, have, f"rank {rank} {arm} step {step} losses")
        assert got["grads"].keys() == plain["grads"].keys()
        for name, grad in plain["grads"].items():
            assert_bitwise(grad, got["grads"][name], f"rank {rank} {arm} {name}")
