"""A built recipe's fields priced as the recipe is (planner/recipe.py): its dispatcher, SMs, layout and hardware are
the recipe's, and what the planner cannot price is refused in one line."""

import copy

import pytest

from ep_overlap_lab.planner import predict
from ep_overlap_lab.planner.cost_model import PROFILES, QWEN3_30B_A3B, Dispatcher, Layout, costs_from_model
from ep_overlap_lab.planner.recipe import RecipeRefusal, price_recipe

NAME = "perf_recipes.qwen3_30b_a3b_pretrain_16gpu_h100_bf16_config"
# What plan_recipe_worker.fields_of read off that recipe, built offline (None fields left out).
FIELDS = {
    "model": {
        "num_layers": 48, "hidden_size": 2048, "num_attention_heads": 32, "kv_channels": 128, "num_query_groups": 4,
        "ffn_hidden_size": 6144, "num_moe_experts": 128, "moe_router_topk": 8, "moe_ffn_hidden_size": 768,
        "moe_layer_freq": 1, "vocab_size": 151936, "seq_length": 4096, "multi_latent_attention": False,
        "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
        "expert_model_parallel_size": 16, "expert_tensor_parallel_size": 1, "sequence_parallel": False,
        "moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "hybridep", "moe_hybridep_num_sms": 32,
        "moe_ncclep_static_shape": False, "bf16": True, "moe_router_score_function": "softmax",
    },
    "global_batch_size": 1024, "micro_batch_size": 1, "dataset_seq_length": 4096, "overlap": True,
    "delay_wgrad": False,
}  # fmt: skip


def _with(**model) -> dict:
    fields = copy.deepcopy(FIELDS)
    fields["model"].update(model)
    return fields


def test_a_recipe_is_priced_with_its_own_dispatcher_sms_and_microbatches():
    price = price_recipe(FIELDS, NAME)
    assert (price.profile, price.gpus, price.microbatches) == ("H100", 16, 64)
    assert price.dispatcher == Dispatcher("hybridep", 32)
    costs, link = costs_from_model(QWEN3_30B_A3B, Layout(16, 16, 1024), PROFILES["H100"], dispatcher=price.dispatcher)
    assert price.speedup == pytest.approx(predict(costs, link, 64).speedup)
    # the seed page measured this recipe's HybridEP path at 1.177x
    assert price.speedup == pytest.approx(24.71 / 20.99, rel=0.05)
    fewer_sms = price_recipe(_with(moe_hybridep_num_sms=8), NAME)
    assert fewer_sms.speedup > price.speedup  # its kernels take fewer SMs from the compute beside them


def test_the_name_picks_the_hardware_and_a_pipeline_adds_its_bubble():
    on_gb200 = price_recipe(FIELDS, NAME.replace("h100", "gb200"))
    assert on_gb200.profile == "GB200" and on_gb200.plain_s < price_recipe(FIELDS, NAME).plain_s
    staged = price_recipe(_with(pipeline_model_parallel_size=2), NAME.replace("16gpu", "32gpu"))
    assert staged.microbatches == 64 and any("PP 2" in note for note in staged.notes)
    # the recipe's layout decides which rank is busiest: 40 of the 48 layers on the first stage
    uneven = _with(pipeline_model_parallel_size=2, pipeline_stages=[["embedding"] + ["decoder"] * 40,
                                                                    ["decoder"] * 8 + ["loss"]])  # fmt: skip
    lopsided = price_recipe(uneven, NAME.replace("16gpu", "32gpu"))
    assert lopsided.plain_s > 1.4 * staged.plain_s  # 40 layers against 24 and the head


@pytest.mark.parametrize(
    "fields, name, words",
    [
        (_with(hybrid_layer_pattern="MEM*E"), NAME, "model.hybrid_layer_pattern='MEM*E': hybrid Mamba layers"),
        (FIELDS, NAME.replace("h100", "vr200"), "its name says VR200, which has no hardware profile"),
        (_with(expert_model_parallel_size=32), NAME, "model.expert_model_parallel_size=32: must divide the 16 ranks"),
        (_with(expert_model_parallel_size=1), NAME, "model.num_moe_experts=128, model.expert_model_parallel_size=1: "),
    ],
)  # fmt: skip
def test_what_the_planner_cannot_price_is_refused_in_one_line(fields, name, words):
    with pytest.raises(RecipeRefusal, match="^" + words.replace("*", r"\*").replace("(", r"\(")) as refusal:
        price_recipe(fields, name)
    assert "\n" not in str(refusal.value)
