"""Builds Megatron-Bridge 0.6.2 recipes offline, as the recipe check does, and writes what the planner prices.

    python plan_recipe_worker.py TREE OUT.json NAME ...     the named recipes (recipes.NAME, perf_recipes.NAME or NAME)
    python plan_recipe_worker.py TREE OUT.json --perf       every performance recipe with MoE and EP above 1

Runs in the recipe check's scratch interpreter (``tests/functional_tests/stock_bridge.py``), importing
``megatron.bridge`` from TREE; ``tests/functional_tests/recipe_check/offline.py`` stands in for the hub and the GPU.
Writes ``{QNAME: {"fields": {...}} or {"why": "..."}}``: the recipe's model, batch and overlap fields as plain JSON
values, or the one line why it could not be built (a name given bare is answered under its qualified name too);
with ``--perf`` also ``"__perf__"``: the performance recipes the recipe check lists (MoE with EP above 1, and those
that fail to build here, whose rows say why). Needs torch (the recipe functions do); the planner never does.
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

MODEL = (
    "num_layers", "hidden_size", "num_attention_heads", "kv_channels", "num_query_groups", "ffn_hidden_size",
    "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
    "moe_layer_freq", "vocab_size", "seq_length", "multi_latent_attention", "q_lora_rank", "kv_lora_rank",
    "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "mtp_num_layers", "hybrid_layer_pattern",
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel",
    "moe_token_dispatcher_type", "moe_flex_dispatcher_backend", "moe_flex_dispatcher_num_sms",
    "moe_hybridep_num_sms", "moe_deepep_num_sms", "moe_ncclep_static_shape", "recompute_granularity",
    "recompute_method", "recompute_num_layers", "recompute_modules", "fp8", "fp4", "bf16",
    "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage", "moe_router_score_function",
)  # fmt: skip


def _plain(value):
    """A JSON value for a config field (enums by name, dtypes and other objects as text)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    name = getattr(value, "name", None)
    return name if isinstance(name, str) else str(value)


def fields_of(cfg) -> dict:
    model = {name: _plain(getattr(cfg.model, name, None)) for name in MODEL}
    layout = getattr(cfg.model, "pipeline_model_parallel_layout", None)
    if layout is not None:  # its virtual stages as kind names (decoder, embedding, mtp, loss), as the check reads them
        from tests.functional_tests.recipe_check.shrink import stages_of

        model["pipeline_stages"] = stages_of(getattr(layout, "input_data", layout))
    overlap = cfg.comm_overlap
    return {
        "model": model,
        "global_batch_size": cfg.train.global_batch_size,
        "micro_batch_size": cfg.train.micro_batch_size,
        "dataset_seq_length": getattr(cfg.dataset, "seq_length", None),
        "overlap": bool(getattr(overlap, "overlap_moe_expert_parallel_comm", False)) if overlap else False,
        "delay_wgrad": bool(getattr(overlap, "delay_wgrad_compute", False)) if overlap else False,
    }


def _build(function) -> dict:
    from tests.functional_tests.recipe_check import offline

    try:
        return {"fields": fields_of(function())}
    except Exception as exc:  # the recipe's own failure here, or the check's limit: one line either way
        limit = offline.limit_of(exc)
        return {"why": limit or f"the recipe fails to build here: {type(exc).__name__}: {exc}"[:300]}


def main(tree: str, out: str, names: list[str]) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.functional_tests.recipe_check import offline

    offline.install(Path(tree))
    from tests.functional_tests.recipe_check.universe import config_functions, resolve_name

    functions = config_functions()
    results = {}
    if names == ["--perf"]:
        listed = []
        for name in (n for n in functions if n.startswith("perf_recipes.")):
            results[name] = _build(functions[name])
            fields = results[name].get("fields")
            model = fields["model"] if fields else {}
            if not fields or ((model["num_moe_experts"] or 0) > 1 and (model["expert_model_parallel_size"] or 1) > 1):
                listed.append(name)
        results["__perf__"] = listed
    for name in names if names != ["--perf"] else []:
        qualified, why = resolve_name(name, list(functions))
        results[name] = {"why": why} if why else _build(functions[qualified])
        if qualified:
            results[qualified] = results[name]
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
