"""Megatron-Bridge 0.6.2's Qwen3-VL MoE model (its ``Qwen3VLModel``) with context parallelism under this project's
plan, bitwise against the plain path, on CPU ranks (gloo).

The model's forward splits the merged text and image embeddings over the context-parallel ranks (zigzag), the image
mask and deepstack features with them, and the multimodal positions it computes from the whole input ids; it gets
this rank's labels and loss mask from ``qwen3_vl_step`` (which leaves the input ids whole). The plan splits them the
same way. ``vl_hook_worker.py --cp 2`` runs it in the stock-Bridge scratch interpreter on Bridge's sources with this
project's patch (its ``qwen3_vl_step`` hunk gives the plan the images), the language layers' core attention the tests'
one that takes context parallelism (``cp_attention.py``); ``--mutate cp-split`` (every rank keeps the first
context-parallel part) makes it fail. Behind ``-m wide``: the model's ``vision_dp_when_cp`` (each context-parallel
rank runs its share of the images through the vision tower; the embeddings are gathered).
"""

import json

import pytest

from tests.functional_tests import stock_bridge

WORKER = stock_bridge.ROOT / "tests" / "functional_tests" / "vl_hook_worker.py"


@pytest.fixture(scope="module")
def python():
    return stock_bridge.scratch_env_or_skip()


def test_qwen3_vl_with_context_parallelism_is_bitwise_equal(python, tmp_path):
    """CP 2 x EP 2 (2 ranks: EP spans the context-parallel pair), PP 1, 2 Adam steps: every microbatch's logged loss,
    every gradient and every parameter after each step equal to the same model's plain forward under Megatron-Core's
    driver."""
    tree = stock_bridge.patched_tree(tmp_path / "patched")
    out = tmp_path / "out.json"
    run = stock_bridge.run(python, tree, WORKER, str(out), "--cp", "2")
    assert run.returncode == 0, run.stderr[-4000:]
    ranks = json.loads(out.read_text())
    assert len(ranks) == 2
    for rank in ranks:
        plain, hook = rank["qwen3_vl"]["plain"], rank["qwen3_vl"]["hook"]
        assert hook["plan"] == "McoreVisionLanguageChunk" and hook["paired"] and plain["images"] > 0
        deepstack = [n for n, g in plain["grads"][-1].items() if "deepstack_merger_list" in n and any(g)]
        assert len(deepstack) >= 2
        for what in ("losses", "grads", "params"):
            assert hook[what] == plain[what], what


@pytest.mark.wide
def test_qwen3_vl_with_the_vision_tower_split_over_context_parallel_ranks_is_bitwise_equal(python, tmp_path):
    """``vision_dp_when_cp``: each context-parallel rank runs its share of a microbatch's images through the vision
    tower and the pair gathers the embeddings; the plan's tower gets the same shares as the plain forward's."""
    tree = stock_bridge.patched_tree(tmp_path / "patched")
    out = tmp_path / "out.json"
    run = stock_bridge.run(python, tree, WORKER, str(out), "--cp", "2", "--vision_dp_when_cp")
    assert run.returncode == 0, run.stderr[-4000:]
    ranks = [rank["qwen3_vl"] for rank in json.loads(out.read_text())]
    assert ranks[0]["plain"]["vision_patches"] != ranks[1]["plain"]["vision_patches"]  # each rank its own share
    for rank in ranks:
        for what in ("vision_patches", "losses", "grads", "params"):
            assert rank["hook"][what] == rank["plain"][what], what
