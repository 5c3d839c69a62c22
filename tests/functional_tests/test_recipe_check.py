"""``tools/recipe_check.py`` (``make recipe-check``) as a user runs it: one cheap recipe of Megatron-Bridge 0.6.2 end
to end, and a name that is not a recipe. Skipped with the reason when the package registry cannot be reached (the
scratch venv comes from it). ``--all`` stays out of CI: its table is in ``docs/training/recipes.md``.
"""

import json
import subprocess
import sys

import pytest

from . import stock_bridge

TOOL = stock_bridge.ROOT / "tools" / "recipe_check.py"
MOONLIGHT = "moonlight_16b_pretrain_8gpu_h100_bf16_config"


@pytest.fixture(scope="module")
def scratch():
    try:
        stock_bridge.scratch_env()
    except stock_bridge.RegistryUnreachable as exc:
        pytest.skip(f"the package registry cannot be reached: {exc}")


def _check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=1500,
                          cwd=stock_bridge.ROOT)  # fmt: skip


def test_a_recipe_with_mla_shared_experts_and_tp_with_sp_trains_bitwise_through_bridges_loop(scratch, tmp_path):
    """Moonlight-16B's H100 recipe (TP 2 with SP, EP 8, MLA, 3 leading dense layers, shared experts, selective
    recompute): shrunk to TP 2 x EP 2 on 2 ranks, a leading dense layer kept, overlap and delayed wgrad on."""
    run = _check(MOONLIGHT, "--json", str(tmp_path / "rows.json"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "recipes: 1 bitwise, 0 refused, 0 differ, 0 failed of 1"
    (row,) = json.loads((tmp_path / "rows.json").read_text())
    assert row["recipe_shape"].startswith("TP2 PP1 CP1 EP8 ETP1 SP 61 layers (3 dense) MLA shared experts")
    assert row["shape"] == "TP2 PP1 CP1 EP2 ETP1 SP 2 layers (1 dense) MLA shared experts" and row["ranks"] == 2
    assert row["config"] == ["moonshotai/Moonlight-16B-A3B -> transformers AutoConfig.for_model('deepseek_v3')"]
    assert "layer spec -> Megatron-Core local, SP norms" in row["substituted"]


def test_a_name_that_is_not_a_recipe_gets_one_line_and_exit_status_2(scratch):
    run = _check("qwen3_30b_a3b_pretrain_8gpu_h100_bf16_config", "no_such_recipe_config")
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "error: no_such_recipe_config: not a recipe function of megatron-bridge 0.6.2; fix: a name from "
        "`python tools/recipe_check.py --list`"
    ]
    assert "recipes:" not in run.stdout
