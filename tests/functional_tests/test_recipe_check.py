"""``tools/recipe_check.py`` (``make recipe-check``) as a user runs it, on a few of Megatron-Bridge 0.6.2's recipes:
a performance recipe that turns the overlap on, and one row per CPU stand-in the check brings (the Mamba kernels,
the gated delta net's kernels, the vision-language local specs, the fused wgrad accumulation), plus the universe's
listing and the names that are not one recipe; the runs are skipped with the reason when the package registry cannot
be reached (the scratch venv comes from it). Config only, no run: the hybrid stack's CPU spec under sequence and
context parallelism. ``--all`` stays out of CI: its table is in ``docs/training/recipes.md``.
"""

import json
import subprocess
import sys

import pytest

from . import stock_bridge

TOOL = stock_bridge.ROOT / "tools" / "recipe_check.py"
# What make test checks: a performance recipe with the overlap on by value (flex HybridEP, CUDA graphs on a GPU),
# Qwen3.5 35B-A3B (gated delta net), Qwen3-VL 30B (vision tower, mrope, deepstack, the patch), Nemotron-3.5 Lightning
# (Mamba, CP, and a repeated MTP layer with delayed wgrad: the fused wgrad accumulation's stand-in).
ROWS = {
    "perf_recipes.qwen3_30b_a3b_pretrain_16gpu_h100_bf16_config": ("dispatcher flex",),
    "recipes.qwen35_text_35b_a3b_pretrain_8gpu_gb200_bf16_config": ("gated delta net kernels -> tests' torch",),
    "perf_recipes.qwen3_vl_30b_a3b_pretrain_8gpu_b200_bf16_config": ("(vl_support)",),
    "recipes.nemotron_3_5_lightning_pretrain_config": (
        "mamba-ssm kernels -> tests' torch stand-ins",
        "gradient accumulation fusion -> tests' torch stand-in",
    ),
}


@pytest.fixture(scope="module")
def scratch():
    stock_bridge.scratch_env_or_skip()


def _check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=2400,
                          cwd=stock_bridge.ROOT)  # fmt: skip


def test_a_performance_recipe_and_each_stand_ins_row_train_bitwise_through_bridges_loop(scratch, tmp_path):
    run = _check(*ROWS, "--json", str(tmp_path / "rows.json"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = {row["recipe"]: row for row in json.loads((tmp_path / "rows.json").read_text())["rows"]}
    assert rows.keys() == ROWS.keys()
    for name, phrases in ROWS.items():
        row = rows[name]
        assert row["verdict"] == "bitwise", (name, row.get("why"))
        for words in phrases:
            assert any(words in said for said in row["substituted"]), (name, words, row["substituted"])
        assert row["gpu"]["verdict"] in ("runs", "refused") and "precision" not in " ".join(row["substituted"]), row
    perf = rows["perf_recipes.qwen3_30b_a3b_pretrain_16gpu_h100_bf16_config"]
    assert perf["setting"] == "on" and perf["gpu"]["verdict"] == "runs", perf
    assert perf["config"] == ["Qwen/Qwen3-30B-A3B: published config.json as Qwen3MoeConfig"], perf["config"]
    assert "[" in run.stderr and f"/{len(ROWS)}" in run.stderr  # a progress line per run
    lines = run.stdout.strip().splitlines()
    assert lines[-1] == f"recipes: {len(ROWS)} bitwise, 0 refused, 0 differ, 0 failed, 0 not checked of {len(ROWS)}"
    assert f"{len(ROWS)} configs, {len(ROWS)} runs" in lines


def test_the_listing_and_names_that_are_not_one_recipe(scratch):
    listing = _check("--list")
    assert listing.returncode == 0, listing.stderr[-3000:]
    universe = [line.split() for line in listing.stdout.splitlines() if not line.startswith("#")]
    settings = {name: " ".join(rest) for name, *rest in universe}
    assert len(settings) >= 273 and set(settings.values()) <= {"on", "off", "unset", "commented out"}
    assert settings["perf_recipes.qwen3_30b_a3b_pretrain_16gpu_h100_bf16_config"] == "on"
    assert "recipes.deepseek_v3_pretrain_config" in settings and "recipes.kimi_k2_pretrain_config" in settings
    both = "qwen3_235b_a22b_pretrain_256gpu_h100_bf16_config"  # in recipes and in perf_recipes
    run = _check(
        "qwen3_30b_a3b_pretrain_8gpu_h100_bf16_config", "no_such_recipe_config", both, "llama3_8b_pretrain_config"
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "error: no_such_recipe_config: not a recipe function of megatron-bridge 0.6.2; fix: a name from "
        "`python tools/recipe_check.py --list`",
        f"error: {both}: in both packages; fix: name one of perf_recipes.{both}, recipes.{both}",
        "error: recipes.llama3_8b_pretrain_config: builds no MoE model with expert_model_parallel_size above 1: the "
        "overlap has nothing to overlap there; fix: a name from `python tools/recipe_check.py --list`",
    ]
    assert "recipes:" not in run.stdout


def test_a_hybrid_stacks_cpu_spec_takes_sequence_and_context_parallelism(monkeypatch):
    """Config only (no run): the hybrid stack's CPU spec gives every layer kind's norm, the MTP block's and the final
    norm the tests' norm that takes sequence parallelism, and attention the context-parallel one, as the GPT one does;
    Megatron-Core's local norm (which refuses sequence parallelism) where the layout has none."""
    import megatron.core.models.hybrid.hybrid_block as hybrid_block
    from megatron.core.transformer import TransformerConfig

    from tests.functional_tests.recipe_check.cpu import recipe_hybrid_spec
    from tests.unit_tests.training.ep_overlap.cp_attention import ContextParallelAttention

    monkeypatch.setattr(hybrid_block, "TENorm", hybrid_block.TENorm)  # the spec sets the final norm in the process
    for parallel in (True, False):
        config = TransformerConfig(
            num_layers=4, hidden_size=16, num_attention_heads=2, num_moe_experts=2, normalization="RMSNorm",
            tensor_model_parallel_size=2 if parallel else 1, sequence_parallel=parallel,
            context_parallel_size=2 if parallel else 1, add_bias_linear=False, use_cpu_initialization=True,
        )  # fmt: skip
        stack = recipe_hybrid_spec(config).submodules
        layers = [stack.attention_layer, stack.mlp_layer, stack.moe_layer, stack.mamba_layer]
        norms = [layer.submodules.input_layernorm for layer in (stack.attention_layer, stack.gdn_layer)]
        norms += [layer.submodules.pre_mlp_layernorm for layer in layers[1:3]] + [stack.mamba_layer.submodules.norm]
        mtp = stack.mtp_block_spec.submodules.layer_specs[0].submodules
        norms += [mtp.enorm, mtp.hnorm, mtp.layer_norm, hybrid_block.TENorm]
        for norm in norms:
            params = list(norm(config, 16, eps=1e-5).parameters())
            assert params and all(getattr(p, "sequence_parallel", False) == parallel for p in params), norm
        attention = stack.attention_layer.submodules.self_attention.submodules.core_attention
        assert (attention is ContextParallelAttention) == parallel, attention
