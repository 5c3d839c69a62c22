"""The recipe check's predicted gain, in a second: the worker's :func:`predicted` on a built config (the fields the
planner's own test reads off ``perf_recipes.qwen3_30b_a3b_pretrain_16gpu_h100_bf16_config``), and the row's cell in
the table and the summary; a pricing that fails or refuses leaves the row's verdicts as they are."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

from tests.functional_tests.recipe_check.worker import predicted
from tests.unit_tests.training.ep_overlap.test_planner_recipe import FIELDS, NAME

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import recipe_check  # noqa: E402


def _cfg(**model_overrides) -> SimpleNamespace:
    return SimpleNamespace(
        model=SimpleNamespace(**(FIELDS["model"] | model_overrides)),
        train=SimpleNamespace(global_batch_size=1024, micro_batch_size=1),
        dataset=SimpleNamespace(seq_length=4096),
        comm_overlap=SimpleNamespace(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=False),
    )


def _row(name: str, gain: dict) -> dict:
    return {"recipe": name, "setting": "on", "gpu": {"verdict": "runs"}, "verdict": "bitwise", "why": "2 steps",
            "gain": json.loads(json.dumps(gain))}  # as the worker's JSON hands it over  # fmt: skip


def test_a_row_carries_the_planners_predicted_gain_and_a_failed_pricing_keeps_the_verdicts():
    gain = predicted(_cfg(), NAME)
    assert (round(gain["speedup"], 3), gain["profile"], gain["gpus"], gain["microbatches"]) == (1.191, "H100", 16, 64)
    refused = predicted(_cfg(), NAME.replace("h100", "vr200"))
    assert refused["why"].startswith("its name says VR200")
    guessed = predicted(_cfg(), "recipes.qwen3_30b_a3b_pretrain_config")  # no GPU in the name: H100, said
    assert recipe_check.gain_words({"gain": guessed}) == "1.19x (16 x H100, its name names no GPU)"
    broken = predicted(SimpleNamespace(model=None), NAME)  # the planner raising: said, never raised
    assert broken["why"].startswith("the planner failed: AttributeError")

    rows = [_row(NAME, gain), _row("perf_recipes.x_vr200", refused), _row("perf_recipes.y_h100", broken)]
    lines = recipe_check.table(rows)
    assert lines[0].split(" | ")[5] == "predicted gain"
    cells = [line.split(" | ") for line in lines[2:]]
    assert [c[5] for c in cells] == [
        "1.19x (16 x H100)",
        f"not priced: {refused['why']}",
        f"not priced: {broken['why']}",
    ]
    assert all(c[3] == "**runs**" and c[-1] == "**bitwise**: 2 steps |" for c in cells)
    summary = recipe_check.summary(rows)
    assert "predicted gain (the planner, overlap on as the recipe is): 1 priced, median 1.19x" in summary[-2]
    assert summary[-1].startswith("recipes: 3 bitwise")
