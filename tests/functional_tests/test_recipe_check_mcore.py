"""Megatron-Core 0.19.2's own plan's verdict beside ours, with no rank (about 15 s of CPU, the recipes' imports):
``recipe_check/mcore_plan.py`` on four of Megatron-Bridge 0.6.2's recipes, built in the stock-Bridge scratch
interpreter, and the summary's 2 x 2 of their rows. One row both plans run (an fp8 recipe with fused permutation and
fused RoPE: what the check's stand-ins answer as a GPU host does), two that Megatron-Core's plan refuses and ours runs
(its ``__post_init__`` assert on pipeline stages without virtual stages; a model without ``build_schedule_plan``), and
one that fails Megatron-Core's own ``finalize()`` with the overlap off, and one whose attention variant 0.19.2 does not
have (its layer spec fails). Skipped with the reason when the package
registry cannot be reached."""

import json
import sys

from . import stock_bridge
from .test_stock_bridge_loop import python  # noqa: F401  (the scratch interpreter, or a skip naming why)

sys.path.insert(0, str(stock_bridge.ROOT / "tools"))
import recipe_check  # noqa: E402

SCRIPT = stock_bridge.ROOT / "tests" / "functional_tests" / "recipe_check" / "mcore_plan.py"
BOTH_RUN = "perf_recipes.qwen3_30b_a3b_pretrain_8gpu_b200_fp8cs_config"
NO_VIRTUAL_STAGES = "recipes.qwen3_30b_a3b_pretrain_8gpu_h100_bf16_config"
NO_SCHEDULE_PLAN = "perf_recipes.qwen3_vl_30b_a3b_pretrain_8gpu_b200_bf16_config"
FAILS = "perf_recipes.qwen3_235b_a22b_pretrain_128gpu_b200_fp8mx_deepep_dev_config"
# Passes every config check of 0.19.2 (it has no fields for V4's features), and fails its model build.
NO_SUCH_VARIANT = "perf_recipes.deepseek_v4_flash_pretrain_128gpu_gb200_fp8mx_config"


def test_megatron_cores_plan_runs_refuses_or_the_recipe_fails_with_the_overlap_off(python, tmp_path):  # noqa: F811
    names = (BOTH_RUN, NO_VIRTUAL_STAGES, NO_SCHEDULE_PLAN, FAILS)
    run = stock_bridge.run(
        python, stock_bridge.site_packages(python), SCRIPT, str(tmp_path / "v.json"), *names, NO_SUCH_VARIANT
    )
    assert run.returncode == 0, run.stderr[-3000:]
    verdicts = json.loads((tmp_path / "v.json").read_text())
    assert verdicts[BOTH_RUN] == {"verdict": "runs", "why": "", "overlap_off": None}
    assert verdicts[NO_VIRTUAL_STAGES]["verdict"] == "refused"
    assert verdicts[NO_VIRTUAL_STAGES]["why"].startswith(
        "AssertionError: If enabling EP A2A overlap, virtual_pipeline_model_parallel_size must be specified"
    )
    assert verdicts[NO_SCHEDULE_PLAN] == {
        "verdict": "refused", "why": "Qwen3VLModel has no build_schedule_plan", "overlap_off": None,
    }  # fmt: skip
    failed = verdicts[FAILS]
    assert failed["verdict"] == "recipe fails" and failed["overlap_off"].startswith(
        "ValueError: Conflicting deprecated SM-count knobs"
    ), failed
    assert failed["why"] == f"with the overlap off: {failed['overlap_off']}"
    v4 = verdicts[NO_SUCH_VARIANT]
    assert v4["verdict"] == "recipe fails", v4
    assert v4["overlap_off"] == "ValueError: Invalid experimental attention variant: dsv4_hybrid"

    # Our GPU verdict on each (docs/training/recipes.md's table): runs. The 2 x 2 counts the failing recipe apart.
    rows = [{"recipe": name, "gpu": {"verdict": "runs"}, "mcore": verdicts[name]} for name in names]
    lines = recipe_check.beside_mcore(rows)
    assert lines[2:7] == [
        "| both run | 1 | 0 | 1 |",
        "| ours runs, Megatron-Core's refuses | 1 | 1 | 2 |",
        "| Megatron-Core's runs, ours refuses | 0 | 0 | 0 |",
        "| both refuse | 0 | 0 | 0 |",
        "| the recipe itself fails with the overlap off | 1 | 0 | 1 |",
    ]
    cells = [line.split(" | ") for line in recipe_check.table(rows)[2:]]
    assert cells[3][4] == f"**recipe fails**: {failed['why']}"
