"""Stock Megatron-Bridge 0.6.2's own training loop runs this project's plan, bitwise, in both install modes.

Each test runs ``stock_bridge_loop.py`` in the scratch interpreter of ``stock_bridge.py`` (upstream's wheel from the
package registry; skipped with the reason when the registry cannot be reached): two gloo ranks, EP 2 (four with
PP 2: the plain 1F1B pipeline), Bridge's
``train_step``, ``gpt_step.forward_step`` and ``get_batch``, Megatron-Core's driver, DDP and optimizer. The arms are
overlap off and the README's recipe (``EPOverlapCommOverlapConfig`` plus the pre-wrap hook); both see the same data,
in which every third token is masked out of the loss.
"""

import json

import pytest

from . import stock_bridge

LOOP = stock_bridge.ROOT / "tests" / "functional_tests" / "stock_bridge_loop.py"


@pytest.fixture(scope="module")
def python():
    return stock_bridge.scratch_env_or_skip()


@pytest.fixture(scope="module")
def plugin(python):
    return stock_bridge.plugin_tree(python)


@pytest.fixture(scope="module")
def patched(python, tmp_path_factory):
    return stock_bridge.patched_tree(tmp_path_factory.mktemp("patched"))


def _arms(python, tree, out, *args) -> list[dict]:
    run = stock_bridge.run(python, tree, LOOP, str(out), *args)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text())


def _assert_the_hook_ran_our_plan(rank: dict, steps: int) -> None:
    plain, hook = rank["plain"], rank["hook"]
    assert not plain["overlap_flag"] and plain["dispatches"] == 0
    assert hook["overlap_flag"] and hook["plan"] == "EPOverlapPlanBuilder"
    assert hook["dispatches"] == 3 * 2 * 2  # the last step: 3 microbatches x 2 MoE layers, forward and backward
    assert len(hook["losses"]) == steps and all(any(v != 0.0 for v in g) for g in hook["grads"][-1].values())


@pytest.mark.parametrize("mode", ["plugin", "patched"])
def test_the_readme_recipe_in_bridges_own_loop_is_bitwise_equal(python, mode, request, tmp_path):
    ranks = _arms(python, request.getfixturevalue(mode), tmp_path / "out.json", "--steps", "3")
    for rank in ranks:
        _assert_the_hook_ran_our_plan(rank, 3)
        for what in ("losses", "grads", "params"):  # every main_grad and parameter after each step
            assert rank["hook"][what] == rank["plain"][what], what


def test_stock_0_6_2_gives_an_mtp_model_other_numbers_with_overlap_on(python, plugin, tmp_path):
    """Upstream's bug: its plain path leaves the loss mask out of the model's forward, so Megatron-Core's MTP loss
    counts the masked tokens there, and not in the overlapped path (which hands the mask over)."""
    ranks = _arms(python, plugin, tmp_path / "out.json", "--steps", "2", "--mtp")
    for rank in ranks:
        _assert_the_hook_ran_our_plan(rank, 2)
        plain, hook = rank["plain"], rank["hook"]
        assert plain["mtp_losses"][0] != hook["mtp_losses"][0]
        assert plain["grads"][0] != hook["grads"][0]


def test_with_the_patch_an_mtp_model_gets_one_set_of_numbers(python, patched, tmp_path):
    ranks = _arms(python, patched, tmp_path / "out.json", "--steps", "2", "--mtp")
    for rank in ranks:
        _assert_the_hook_ran_our_plan(rank, 2)
        for what in ("losses", "mtp_losses", "grads", "params"):
            assert rank["hook"][what] == rank["plain"][what], what


def test_without_a_loss_mask_stock_and_patched_mtp_numbers_agree(python, plugin, tmp_path):
    """The patch's plain-path hunk changes nothing when every token counts (the mask is then all ones)."""
    ranks = _arms(python, plugin, tmp_path / "out.json", "--steps", "1", "--mtp", "--mask_every", "0")
    for rank in ranks:
        assert rank["hook"]["mtp_losses"] == rank["plain"]["mtp_losses"]
        assert rank["hook"]["grads"] == rank["plain"]["grads"]


def test_a_packed_run_stops_before_its_first_step_as_a_plugin_naming_the_fix(python, plugin, tmp_path):
    """Stock 0.6.2's forward step would hand our plan a packed microbatch without its document boundaries: the plan
    builder sees that in Bridge's own call and refuses it, on every rank, before any optimizer step. (The other side,
    no false alarm on padded data through the same forward step, is every other test of this file.)"""
    run = stock_bridge.run(python, plugin, LOOP, str(tmp_path / "out.json"), "--steps", "1", "--arms", "hook",
                           "--packed")  # fmt: skip
    assert run.returncode != 0 and not (tmp_path / "out.json").exists()
    assert run.stderr.count("2 of 2 ranks failed") == 1
    assert run.stderr.count("Megatron-Bridge's gpt_step forward step (0.6.2, unpatched)") >= 2  # both ranks
    assert "fix: apply this project's patch (tools/upstream.py patch" in run.stderr
    assert "optimizer.step" not in run.stderr and "in _forward_step_common" in run.stderr


def test_with_the_patch_packed_documents_train_bitwise_equal_through_bridges_loop(python, patched, tmp_path):
    """The patched gpt_step hands the plan the packed parameters; with the tests' THD core attention (causal within
    each document) both arms train the same numbers."""
    ranks = _arms(python, patched, tmp_path / "out.json", "--steps", "2", "--packed")
    for rank in ranks:
        _assert_the_hook_ran_our_plan(rank, 2)
        for what in ("losses", "grads", "params"):
            assert rank["hook"][what] == rank["plain"][what], what


def test_full_recompute_set_in_the_recipe_is_refused_with_our_line_not_megatron_cores_assert(python, plugin, tmp_path):
    """Megatron-Core's config asserts on full recompute with the overlap flag when Bridge builds it; the recipe's
    setup refuses first, naming the hook's keyword that sets it on the built config."""
    run = stock_bridge.run(python, plugin, LOOP, str(tmp_path / "out.json"), "--steps", "1", "--arms", "hook",
                           "--full_recompute", "recipe")  # fmt: skip
    assert run.returncode != 0 and not (tmp_path / "out.json").exists()
    assert run.stderr.count("[full_recompute_in_the_recipe]") >= 2  # both ranks
    assert "full_recompute=('uniform', 1)" in run.stderr
    assert "transformer_config.py" not in run.stderr  # Megatron-Core's own assert never ran


def test_full_recompute_given_to_the_hook_trains_bitwise_equal_in_bridges_loop(python, plugin, tmp_path):
    ranks = _arms(python, plugin, tmp_path / "out.json", "--steps", "2", "--full_recompute", "hook")
    for rank in ranks:
        _assert_the_hook_ran_our_plan(rank, 2)
        for what in ("losses", "grads", "params"):
            assert rank["hook"][what] == rank["plain"][what], what


def test_with_the_patch_the_plain_1f1b_pipeline_pairs_bitwise_equal_in_bridges_loop(python, patched, tmp_path):
    """PP 2 without virtual stages (4 ranks), the README's recipe (delayed wgrad on): the recipe's setup keeps the
    overlap and delayed-wgrad flags off the provider (Megatron-Core's config refuses them there), the patched setup
    sets them just before the build (the layers are built delaying), and the patched train() takes this project's
    get_forward_backward_func, which pairs the steps."""
    ranks = _arms(python, patched, tmp_path / "out.json", "--steps", "2", "--pp", "2")
    assert len(ranks) == 4
    for index, rank in enumerate(ranks):
        plain, hook = rank["plain"], rank["hook"]
        assert hook["built_with"] == {"overlap": True, "delay": True}
        assert plain["built_with"] == {"overlap": False, "delay": False}
        assert hook["overlap_flag"] and hook["dispatches"] == 3 * 1 * 2  # one MoE layer a stage
        # 3 microbatches fill the first stage's warm-up (2 (P - r - 1) + 1 forwards); the last stage pairs.
        assert hook["paired"] is (index >= 2)
        assert bool(hook["losses"][-1]) is (index >= 2)  # the last stage's ranks report the losses
        for what in ("losses", "grads", "params"):
            assert hook[what] == plain[what], what


def test_delayed_latent_and_mtp_wgrads_all_reach_main_grad_in_bridges_loop(python, patched, tmp_path):
    """Nemotron 3 Super's MoE (recipe check): latent projections whose weight gradients Transformer Engine delays
    (the tests' stand-in, without gradient_accumulation_fusion: one deferred gradient per ``backward_dw``, handed to
    ``main_grad`` by the DDP's hooks) and 2 MTP depths. Every microbatch's delayed gradient reaches ``main_grad`` only
    where the DDP config delays too (Bridge leaves it off)."""
    ranks = _arms(python, patched, tmp_path / "out.json", "--steps", "2", "--model", "latent_mtp")
    for rank in ranks:
        assert rank["hook"]["plan"] == "EPOverlapPlanBuilder" and rank["hook"]["dispatches"] == 3 * 2 * 2
        assert any("fc1_latent_proj" in name for name in rank["hook"]["grads"][0])
        for what in ("losses", "grads", "params"):
            assert rank["hook"][what] == rank["plain"][what], what


def test_as_a_plugin_the_plain_1f1b_pipeline_stops_before_step_1_naming_the_patch(python, plugin, tmp_path):
    run = stock_bridge.run(python, plugin, LOOP, str(tmp_path / "out.json"), "--steps", "1", "--arms", "hook",
                           "--pp", "2")  # fmt: skip
    assert run.returncode != 0 and not (tmp_path / "out.json").exists()
    assert run.stderr.count("4 of 4 ranks failed") == 1
    assert "Megatron-Bridge's train() (unpatched) takes Megatron-Core's get_forward_backward_func" in run.stderr
    assert "fix: apply this project's patch (tools/upstream.py patch)" in run.stderr
    assert "optimizer.step" not in run.stderr


@pytest.mark.parametrize("mode", ["plugin", "patched"])
def test_tensor_and_sequence_parallelism_train_bitwise_equal_in_bridges_loop(python, mode, request, tmp_path):
    """TP 2 with sequence parallelism x EP 2 (4 ranks), as upstream's TP 2 overlap recipes set it: Bridge's own
    provider, setup and loop; the tests' norm that takes sequence parallelism in both arms."""
    ranks = _arms(python, request.getfixturevalue(mode), tmp_path / "out.json", "--steps", "2", "--tp", "2")
    assert len(ranks) == 4
    for rank in ranks:
        _assert_the_hook_ran_our_plan(rank, 2)
        for what in ("losses", "grads", "params"):
            assert rank["hook"][what] == rank["plain"][what], what


@pytest.mark.parametrize("mode", ["plugin", "patched"])
def test_bridges_gpt_oss_provider_trains_bitwise_equal_in_bridges_loop(python, mode, request, tmp_path):
    """Bridge 0.6.2's GPT-OSS provider (``GPTOSSBridge`` from a shrunk ``GptOssConfig``): biases, learnable softmax
    sinks, a sliding window on every other layer, YaRN, the clamped quick-GELU; the README's recipe in both modes."""
    ranks = _arms(python, request.getfixturevalue(mode), tmp_path / "out.json", "--steps", "2", "--model", "gpt_oss")
    for rank in ranks:
        _assert_the_hook_ran_our_plan(rank, 2)
        grads = rank["hook"]["grads"][-1]
        for part in ("linear_proj.bias", "experts.local_experts.0.linear_fc1.bias", "softmax_offset"):
            assert any(part in name for name in grads), part
        for what in ("losses", "grads", "params"):
            assert rank["hook"][what] == rank["plain"][what], what


def test_the_readme_recipe_is_the_one_these_tests_run():
    """The README's first-screen snippet, line for line, is the recipe ``stock_bridge_loop.py`` runs; its last line,
    ``pretrain(cfg, forward_step)``, is what that script runs step by step up to ``train()`` (``setup()`` needs
    CUDA)."""
    import re
    import textwrap

    readme = (stock_bridge.ROOT / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    *recipe, last = [line for line in snippet.splitlines() if line.strip()]
    assert last.startswith("pretrain(cfg, forward_step)")
    script = LOOP.read_text()
    block = script[script.index("# ---- the README's recipe lines ----") : script.index("# ---- end of the recipe")]
    ours = [line for line in textwrap.dedent(block.split("\n", 1)[1]).splitlines() if line.strip()]
    assert ours == recipe
