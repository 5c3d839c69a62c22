"""Microbatch input: correct loss normalisation for any sizes and ignored labels; bad ids refused on every rank."""

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ep_overlap_lab.engine import EPOverlapEngine
from ep_overlap_lab.moe_gpt import MoEGPTModel
from megatron.bridge.training.ep_overlap import IGNORE_INDEX

from .local_ranks import init_ep_groups, run_local_ranks
from .workers import Case

CASE = Case(layer_freq=(1, 0), microbatches=3)
SIZES = {0: (2, 1, 3), 1: (1, 3, 1)}  # micro-batch sizes differ within a step and across ranks


def _data(rank: int, ignore: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7 + rank)
    out = []
    for size in SIZES[rank]:
        tokens = torch.randint(0, 64, (size, CASE.seq_length), generator=gen)
        labels = torch.randint(0, 64, (size, CASE.seq_length), generator=gen)
        if ignore:
            labels[:, : CASE.seq_length // 2] = IGNORE_INDEX  # e.g. a prompt that is not trained on
        out.append((tokens, labels))
    return out


def _global_mean_vs_engine(rank: int, world: int, ignore: bool) -> dict:
    groups = init_ep_groups(2, timedelta(seconds=30))
    data = _data(rank, ignore)
    results = {}
    for overlap in (False, True):
        model = MoEGPTModel(CASE.config(), groups)
        with torch.no_grad():  # the definition: summed token cross-entropy over counted tokens, all ranks
            ce = torch.stack([model(tokens, labels, 1.0) for tokens, labels in data]).sum()
            counted = torch.tensor(float(sum(int((labels != IGNORE_INDEX).sum()) for _, labels in data)))
        dist.all_reduce(ce)
        dist.all_reduce(counted)
        loss = torch.stack(EPOverlapEngine(model, groups, overlap=overlap).step(data).losses).sum()
        dist.all_reduce(loss)
        results[overlap] = (loss, ce / counted)
    return results


@pytest.mark.parametrize("ignore", [False, True])
def test_loss_is_the_mean_over_counted_tokens_of_every_rank(ignore):
    for outcome in run_local_ranks(_global_mean_vs_engine, 2, (ignore,)):
        (plain, expected), (overlapped, _) = outcome.result[False], outcome.result[True]
        assert torch.equal(plain.view(torch.int32), overlapped.view(torch.int32))  # bitwise, as always
        torch.testing.assert_close(plain, expected, rtol=1e-6, atol=0)


def _changed(rank: int, data: list, what: str) -> list:
    """The step's input changed as ``what`` says: rank 1's, but for "all_ignored" (every rank's labels)."""
    if what == "all_ignored":
        for _, labels in data:
            labels.fill_(IGNORE_INDEX)
        return data
    if rank != 1:
        return data
    tokens, labels = data[0]
    if what == "token":
        data[2][0][0, 1] = 64
    elif what == "label":
        data[2][1][0, 0] = -5
    elif what == "count":
        data = data[:2]
    elif what == "dtype":
        data = [(t.to(torch.int32), labels_) for t, labels_ in data]
    else:
        data[0] = {
            "bool tokens": (tokens > 30, labels),
            "uint8 tokens": (tokens.to(torch.uint8), labels),
            "sequence length": (tokens[:, :-2], labels[:, :-2]),
        }[what]
    return data


def _step_with(rank: int, world: int, what: str) -> str:
    groups = init_ep_groups(2, timedelta(seconds=60))  # a hang would wait this long; the checks answer at once
    data = _changed(rank, _data(rank, ignore=False), what)
    EPOverlapEngine(MoEGPTModel(CASE.config(), groups), groups, overlap=True).step(data)
    return "ran"


@pytest.mark.parametrize(
    "corrupt, detail",
    [
        ("token", "rank 1: microbatch 2: token ids must be in [0, 64), found "),
        ("label", "rank 1: microbatch 2: labels must be in [0, 64) or -100 (ignored), found -5.."),
    ],
)
def test_out_of_range_ids_fail_every_rank_at_once_naming_rank_and_microbatch(corrupt, detail):
    outcomes = run_local_ranks(_step_with, 2, (corrupt,), raise_on_error=False, collective_timeout_s=30)
    assert "bad microbatch input on rank(s) [1]" in outcomes[0].error
    assert "this rank's input is fine" in outcomes[0].error
    assert detail in outcomes[1].error
    for outcome in outcomes:
        assert "ValueError" in outcome.error and "CollectiveError" not in outcome.error


def test_a_step_with_every_label_ignored_is_refused():
    outcomes = run_local_ranks(_step_with, 2, ("all_ignored",), raise_on_error=False)
    for outcome in outcomes:
        assert "every label of this step is IGNORE_INDEX (-100)" in outcome.error


@pytest.mark.parametrize(
    "what, line",
    [
        ("count", "microbatches per step: rank 0 has 3, rank 1 has 2"),
        ("dtype", "token dtype: rank 0 has torch.int64, rank 1 has torch.int32"),
    ],
)
def test_ranks_that_disagree_fail_together_before_any_all_to_all(what, line):
    start = time.monotonic()
    outcomes = run_local_ranks(_step_with, 2, (what,), raise_on_error=False, collective_timeout_s=60)
    assert time.monotonic() - start < 30  # not the collective timeout
    for outcome in outcomes:
        assert "the ranks disagree on the step's shape" in outcome.error and line in outcome.error
        assert "CollectiveError" not in outcome.error


@pytest.mark.parametrize(
    "what, detail",
    [
        ("bool tokens", "tokens must be int64 or int32 ids and labels int64, not torch.bool/torch.int64"),
        ("uint8 tokens", "tokens must be int64 or int32 ids and labels int64, not torch.uint8/torch.int64"),
        ("sequence length", f"sequences of {CASE.seq_length - 2} tokens, but the model takes {CASE.seq_length}"),
    ],
)
def test_malformed_tokens_are_refused_up_front_on_every_rank(what, detail):
    outcomes = run_local_ranks(_step_with, 2, (what,), raise_on_error=False)
    for outcome in outcomes:
        assert "bad microbatch input on rank(s) [1]" in outcome.error and "ValueError" in outcome.error
    assert f"rank 1: microbatch 0: {detail}" in outcomes[1].error


def _nan_on(rank: int, world: int, bad_rank: int) -> str:
    groups = init_ep_groups(2, timedelta(seconds=30))
    model = MoEGPTModel(CASE.config(), groups)
    data = _data(rank, ignore=False)
    for tokens, _ in data:
        tokens[tokens == 5] = 6
    if rank == bad_rank:
        with torch.no_grad():
            model.word_embeddings.weight[5] = float("nan")
        data[1][0][0, 0] = 5  # only microbatch 1 of this rank reads the NaN row
    EPOverlapEngine(model, groups, overlap=True).step(data)
    return "ran"


def test_a_non_finite_loss_or_gradient_is_reported_on_every_rank_naming_rank_and_microbatch():
    outcomes = run_local_ranks(_nan_on, 2, (1,), raise_on_error=False)
    for outcome in outcomes:
        assert "FloatingPointError: non-finite values in this step" in outcome.error
        assert "rank 1: the loss of microbatch 1 is not finite" in outcome.error
        assert "rank 0: the loss of" not in outcome.error  # the rank it came from is the one named for the loss
    assert "rank 1: a gradient is not finite (first: " in outcomes[1].error
