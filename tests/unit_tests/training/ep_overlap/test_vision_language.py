"""Megatron-Bridge 0.6.2's Qwen3-VL MoE and Qwen3.5-VL MoE models (its ``Qwen3VLModel``: vision tower, deepstack
features, multimodal rotary positions; gated delta net and gated attention layers) under this project's plan, bitwise
against the plain path, on CPU ranks (gloo).

Each test runs a worker of ``tests/functional_tests/`` in the stock-Bridge scratch interpreter of ``stock_bridge.py``
(upstream's wheel from the package registry; skipped, saying so, when the registry cannot be reached): Bridge's model
classes, Megatron-Core's local specs where Bridge names Transformer Engine's (``vl_support.py``). Every step mixes
microbatches with images (one row with two images) and text-only ones. ``vl_hook_worker.py --mutate`` makes the plan
skip the vision merge, the multimodal positions, the deepstack features or the MTP layer's multimodal rotary
embedding; each makes the bitwise test fail.
"""

import json

import pytest

from tests.functional_tests import stock_bridge

WORKERS = stock_bridge.ROOT / "tests" / "functional_tests"


@pytest.fixture(scope="module")
def python():
    return stock_bridge.scratch_env_or_skip()


@pytest.fixture(scope="module")
def plugin(python):
    return stock_bridge.plugin_tree(python)


@pytest.fixture(scope="module")
def patched(python, tmp_path_factory):
    return stock_bridge.patched_tree(tmp_path_factory.mktemp("patched"))


def _ranks(python, tree, worker: str, out, *args) -> list[dict]:
    run = stock_bridge.run(python, tree, WORKERS / worker, str(out), *args)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text())


def _nonzero(grads: dict, part: str) -> list[str]:
    return [name for name, grad in grads.items() if part in name and any(v != 0.0 for v in grad)]


def test_qwen3_vl_and_qwen35_vl_at_pp2_vpp2_under_megatron_cores_driver_are_bitwise_equal(python, plugin, tmp_path):
    """PP 2 x VPP 2 x EP 2 (4 ranks), Megatron-Core's interleaved schedule with its P2P hooks, 2 Adam steps, against
    the same model's plain interleaved schedule: the vision tower on the first chunk of rank 0's stage, multimodal
    positions on every chunk (the last stage's too); Qwen3-VL with its two deepstack layers on that chunk, Qwen3.5-VL
    with gated delta net and gated attention layers, gated shared experts and its MTP layer (which reads the
    microbatch's multimodal rotary embedding in the last stage's head)."""
    ranks = _ranks(python, plugin, "vl_hook_worker.py", tmp_path / "out.json", "--pp", "2",
                   "--models", "qwen3_vl,qwen35_vl")  # fmt: skip
    assert len(ranks) == 4
    for index, rank in enumerate(ranks):
        for model, arms in rank.items():
            plain, hook = arms["plain"], arms["hook"]
            assert hook["plan"] == "McoreVisionLanguageChunk" and hook["paired"]
            assert hook["dispatches"] == 4 * 4 * 2  # the last step: 4 microbatches x 4 MoE layers, both directions
            assert plain["images"] == hook["images"] > 0
            assert all(bool(losses) is (index >= 2) for losses in plain["losses"])  # the last stage's ranks
            grads = plain["grads"][-1]
            if index < 2:  # the first stage holds the vision tower
                assert _nonzero(grads, "vision_model.patch_embed"), model
                assert len(_nonzero(grads, "deepstack_merger_list")) >= (2 if model == "qwen3_vl" else 0)
            if model == "qwen35_vl":  # gated delta net and gated shared-expert weights train; the MTP layer's too
                assert _nonzero(grads, "self_attention.A_log") and _nonzero(grads, "shared_experts.gate_weight")
                assert bool(_nonzero(grads, "language_model.mtp.")) is (index >= 2)
            for what in ("losses", "grads"):
                assert hook[what] == plain[what], (model, what)


def test_qwen3_vl_with_full_recompute_given_to_the_hook_is_bitwise_equal(python, plugin, tmp_path):
    """Full recompute of the language layers (``uniform``, 1; the hook's keyword, set on the built config in both
    arms), PP 1 x EP 2: the plan replays each layer before its backward, the deepstack additions with it, against the
    language block's checkpointed forward."""
    ranks = _ranks(python, plugin, "vl_hook_worker.py", tmp_path / "out.json", "--full_recompute")
    for rank in ranks:
        plain, hook = rank["qwen3_vl"]["plain"], rank["qwen3_vl"]["hook"]
        assert len(_nonzero(plain["grads"][-1], "deepstack_merger_list")) >= 2
        for what in ("losses", "grads"):
            assert hook[what] == plain[what], what


def test_qwen3_vl_with_sequence_parallelism_is_bitwise_equal(python, plugin, tmp_path):
    """TP 2 with sequence parallelism x EP 2 (4 ranks), PP 1: the plan scatters the merged embeddings over the
    tensor-parallel pair and splits the image mask and the deepstack features as the model's forward does
    (``--mutate sp-split``, every rank keeping the first part, makes it fail)."""
    ranks = _ranks(python, plugin, "vl_hook_worker.py", tmp_path / "out.json", "--tp", "2")
    assert len(ranks) == 4
    for rank in ranks:
        plain, hook = rank["qwen3_vl"]["plain"], rank["qwen3_vl"]["hook"]
        assert hook["plan"] == "McoreVisionLanguageChunk" and hook["paired"] and plain["images"] > 0
        assert len(_nonzero(plain["grads"][-1], "deepstack_merger_list")) >= 2
        for what in ("losses", "grads"):
            assert hook[what] == plain[what], what


@pytest.mark.wide
def test_qwen3_vl_and_qwen35_vl_with_sequence_parallelism_at_pp2_vpp2_are_bitwise_equal(python, plugin, tmp_path):
    """PP 2 x VPP 2 x TP 2 (sequence parallelism) x EP 2: 8 ranks, Megatron-Core's interleaved schedule."""
    ranks = _ranks(python, plugin, "vl_hook_worker.py", tmp_path / "out.json", "--tp", "2", "--pp", "2",
                   "--models", "qwen3_vl,qwen35_vl")  # fmt: skip
    assert len(ranks) == 8
    for rank in ranks:
        for model, arms in rank.items():
            assert arms["hook"]["paired"] and arms["plain"]["images"] > 0
            for what in ("losses", "grads"):
                assert arms["hook"][what] == arms["plain"][what], (model, what)


def test_with_the_patch_qwen3_vl_and_qwen35_vl_train_bitwise_equal_through_bridges_loop(python, patched, tmp_path):
    """Bridge's own ``train()`` with ``qwen3_vl_step.forward_step`` (patched: the plan gets the images) and the models
    Bridge's providers build, PP 1 x EP 2, 2 steps: losses, every gradient and every parameter equal to overlap
    off."""
    ranks = _ranks(python, patched, "vl_bridge_loop.py", tmp_path / "out.json", "--models", "qwen3_vl,qwen35_vl")
    for rank in ranks:
        for model, arms in rank.items():
            plain, hook = arms["plain"], arms["hook"]
            assert hook["chunk"] == "McoreVisionLanguageChunk" and hook["dispatches"] == 4 * 2 * 2
            assert _nonzero(plain["grads"][-1], "vision_model"), model
            for what in ("losses", "grads", "params"):
                assert hook[what] == plain[what], (model, what)


def test_as_a_plugin_a_microbatch_with_images_is_refused_before_any_compute_naming_the_patch(python, plugin, tmp_path):
    """Stock 0.6.2's ``qwen3_vl_step`` hands the plan neither the pixel values nor the grids: the plan sees image
    tokens in the input ids with no images given and refuses the microbatch on every rank, before any step."""
    out = tmp_path / "out.json"
    run = stock_bridge.run(python, plugin, WORKERS / "vl_bridge_loop.py", str(out), "--arms", "hook", "--steps", "1")
    assert run.returncode != 0 and not out.exists()
    assert run.stderr.count("2 of 2 ranks failed") == 1
    line = "EP-overlap build_schedule_plan: pixel_values, image_grid_thw: input_ids hold 4 image tokens (id 62)"
    assert run.stderr.count(line) >= 2  # both ranks
    assert "fix: apply this project's patch (tools/upstream.py patch: its qwen3_vl_step hunk" in run.stderr
    assert "optimizer.step" not in run.stderr and "in forward_step" in run.stderr
