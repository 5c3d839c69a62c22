"""The recipe check's worker: Megatron-Bridge 0.6.2's recipes, built, judged as they are, shrunk to CPU size and
trained 2 steps by Bridge's own loop with the overlap off and on (run by ``tools/recipe_check.py`` in the stock-Bridge
scratch interpreter; test-only stand-ins, never product).

    python worker.py TREE OUT.json --universe [--judge NAME ...]    every config function, built (and judged)
    python worker.py TREE OUT.json --recipe QNAME [--patched]       one CPU run: shape, substitutions, verdict
    python worker.py TREE OUT.jsonl --recipes QNAME ... [--patched]  several, one JSON line each, as each ends

What runs, in order:

1. **The recipe as a user builds it** (``universe.py``), offline (``offline.py``: the published config fields the
   check carries, an H100's properties, empty ``diffusers``). The recipe function runs unchanged.
2. **As the recipe is, on a GPU** (``verdicts.gpu_verdict``): this project's rules on the unshrunk config with the
   overlap on; Megatron-Core's own plan's verdict on copies of it (``mcore_plan.mcore_verdict``: its and Bridge's
   checks, overlap off and on); and the planner's predicted gain (:func:`predicted`), priced from the same config.
3. **The overlap on, as Bridge's performance scripts' ``--moe_a2a_overlap true`` does** (:func:`overlap_on`): the
   overlap flag and delayed wgrad, ``moe_shared_expert_overlap`` off; this project's config class and pre-wrap hook
   (the README's recipe lines); a recipe's full recompute through the hook's ``full_recompute`` keyword.
4. **Shrunk, structure kept** (``shrink.py``) and **the CPU substitutions, named** (``cpu.py``).
5. **Bridge's ``train()``**, 2 steps per arm on gloo ranks (``stock_bridge_loop.bridge_train``), with the patch where
   the layout needs it (the plain 1F1B pipeline); the verdict (``verdicts.verdict``).

The universe pass also gives each row the key of its CPU run: the shrunk, substituted model provider's fields, the
hook's keywords and the tree (plugin or patch). Rows with one key share one run; each keeps its own words.
"""

import argparse
import copy
import dataclasses
import functools
import hashlib
import json
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PERF_SCRIPTS = ROOT / "scripts" / "performance"  # the planner's recipe entry (``utils.plan_recipe``)


def overlap_on(cfg) -> dict:
    """The hook's keywords; ``cfg`` gets what ``--moe_a2a_overlap true`` sets (kept for the check's hook arm)."""
    model = cfg.model
    keywords = {"attention_wgrad_window": 1}
    if model.recompute_granularity == "full":
        keywords["full_recompute"] = (model.recompute_method, model.recompute_num_layers)
    model.moe_shared_expert_overlap = False
    return keywords


def describe(model) -> str:
    """The layout and the layer structure, in a few words."""
    from tests.functional_tests.recipe_check.shrink import layout_text, stages_of

    parts = [f"{short}{getattr(model, name) or 1}" for short, name in (
        ("TP", "tensor_model_parallel_size"), ("PP", "pipeline_model_parallel_size"),
        ("CP", "context_parallel_size"), ("EP", "expert_model_parallel_size"), ("ETP", "expert_tensor_parallel_size"),
    )]  # fmt: skip
    if model.virtual_pipeline_model_parallel_size:
        parts.append(f"VPP{model.virtual_pipeline_model_parallel_size}")
    if model.sequence_parallel:
        parts.append("SP")
    freq = model.moe_layer_freq
    dense = freq.count(0) if isinstance(freq, list) else 0
    parts.append(f"{model.num_layers} layers ({dense} dense)" if dense else f"{model.num_layers} layers")
    layout = model.pipeline_model_parallel_layout
    if layout is not None:
        layout = getattr(layout, "input_data", layout)
        parts.append(f"layout {layout_text(stages_of(layout))}")
    first, last = model.num_layers_in_first_pipeline_stage, model.num_layers_in_last_pipeline_stage
    if first is not None or last is not None:
        parts.append(f"first/last stage {first}/{last} layers")
    if getattr(model, "hybrid_layer_pattern", None):
        parts.append(f"pattern {model.hybrid_layer_pattern}")
    words = {"multi_latent_attention": "MLA", "mtp_num_layers": "MTP",
             "moe_shared_expert_intermediate_size": "shared experts", "add_bias_linear": "biases"}  # fmt: skip
    for flag, word in words.items():
        if getattr(model, flag, None):
            parts.append(word)
    return " ".join(parts)


def _plain(value):
    """A provider field as JSON can say it, the same for two equal configs (no object addresses)."""
    if isinstance(value, functools.partial):
        return ["partial", _plain(value.func), [_plain(a) for a in value.args]]
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    text = repr(value)
    return type(value).__qualname__ if " at 0x" in text else text


def run_key(model, keywords: dict, patched: bool) -> str:
    """What decides a CPU run: the shrunk, substituted provider (every field, so the recipe's own value of a field
    the CPU run replaces does not count), the hook's keywords and the tree. Rows with the same key share one run."""
    fields = {f.name: _plain(getattr(model, f.name, None)) for f in dataclasses.fields(model)}
    blob = json.dumps([type(model).__qualname__, fields, keywords, patched], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def prepared(cfg) -> dict:
    """``cfg`` with the overlap on, shrunk and substituted for CPU, in place: what the CPU run will be."""
    from tests.functional_tests.recipe_check.cpu import family_of, on_cpu
    from tests.functional_tests.recipe_check.shrink import shrink

    keywords = overlap_on(cfg)
    shape = shrink(cfg.model)
    substituted = shape.pop("substituted") + on_cpu(cfg)
    if "full_recompute" in keywords:
        substituted.append("full recompute -> the hook's full_recompute keyword")
    model = cfg.model
    needs = []  # why this run takes Bridge with this project's patch
    if model.pipeline_model_parallel_size > 1 and not model.virtual_pipeline_model_parallel_size:
        needs.append("the plain 1F1B pipeline pairs only under the patched train()")
    if family_of(model) == "vision_language":
        needs.append("stock qwen3_vl_step hands the plan no images")
    elif getattr(model, "mtp_num_layers", None):  # the check's data masks some tokens
        needs.append("stock gpt_step leaves the loss mask out of the plain path's MTP loss")
    if needs:
        substituted.append(f"Bridge 0.6.2 patched ({'; '.join(needs)})")
    return {"keywords": keywords, "shape": shape, "substituted": substituted, "patched": bool(needs)}


def predicted(cfg, name: str) -> dict:
    """The planner's predicted gain for the recipe as it is, with the overlap on, on the hardware its name says
    (``plan_recipe.predicted_gain``, torch-free; ``cfg`` only read): speedup, steps, GPUs, or ``{"why": one line}``.
    Never raises: a pricing that fails says so in its ``why``, and the row keeps its verdicts."""
    try:
        if str(PERF_SCRIPTS) not in sys.path:
            sys.path.append(str(PERF_SCRIPTS))  # last: nothing the worker already finds is shadowed
        from utils.plan_recipe import predicted_gain

        gain = predicted_gain(cfg, name)
    except Exception as error:
        line = (str(error).strip().splitlines() or [""])[-1]
        return {"why": f"the planner failed: {type(error).__name__}: {line}"[:300]}
    if "why" in gain:
        return {"why": gain["why"]}
    return {key: gain[key] for key in ("speedup", "plain_s", "overlap_s", "profile", "gpus", "microbatches", "notes")}


def universe_row(name: str, function, configs, judged: bool = True) -> dict:
    """One config function: built and classified; where ``judged``, its verdicts as it is and its CPU run's key."""
    from tests.functional_tests.recipe_check import universe
    from tests.functional_tests.recipe_check.mcore_plan import mcore_verdict
    from tests.functional_tests.recipe_check.verdicts import gpu_verdict

    configs.clear()
    row = {"recipe": name, "family": universe.family(function)}
    try:
        cfg = function()
    except Exception as error:  # a recipe that does not build here: the check's limit or the recipe's
        why, limit = built_error(error, configs)
        return row | {"built": False, "limit": limit, "why": why, "config": list(configs.used)}
    row |= {"built": True, "moe_ep": universe.is_moe_with_ep(cfg.model), "config": list(configs.used)}
    if not row["moe_ep"]:
        return row
    if not judged:
        return row | {"setting": universe.setting(cfg, function)}
    # the gain is priced here, on the recipe as built: prepared() below shrinks cfg in place
    row |= {"setting": universe.setting(cfg, function), "recipe_shape": describe(cfg.model), "gpu": gpu_verdict(cfg),
            "mcore": mcore_verdict(cfg), "gain": predicted(cfg, name)}  # fmt: skip
    try:
        run = prepared(cfg)
    except Exception as error:
        return row | {"limit": True, "why": f"the check could not shrink it: {str(error).strip().splitlines()[-1]}",
                      "trace": traceback.format_exc()[-2000:]}  # fmt: skip
    key = run_key(cfg.model, run["keywords"], run["patched"])
    return row | {"shape": describe(cfg.model), "ranks": run["shape"]["world"], "substituted": run["substituted"],
                  "needs_patch": run["patched"], "key": key}  # fmt: skip


def built_error(error: BaseException, configs) -> tuple[str, bool]:
    """Why a recipe did not build here, and whether that is the check's limit (no stored config, a partial one, an
    empty stand-in) rather than the recipe's."""
    from tests.functional_tests.recipe_check.offline import LIMIT, limit_of

    limit = limit_of(error)
    if limit:
        return limit, True
    line = (str(error).strip().splitlines() or [type(error).__name__])[-1]
    missing = getattr(error, "filename", None) if isinstance(error, FileNotFoundError) else None
    if missing and "/megatron/bridge/" in missing:  # the recipe reads a file its own wheel does not ship
        return f"building: Megatron-Bridge 0.6.2's wheel lacks {missing.split('/megatron/bridge/')[-1]}", False
    if configs.partial:
        return f"{LIMIT} build it from the partial fields it carries for {', '.join(configs.partial)}: {line}", True
    return f"building: {line}", False


def universe_rows(configs, judge: list[str] | None = None) -> list[dict]:
    """Every config function's row; judged (verdicts, shrunk shape) only where its name or its bare name is in
    ``judge`` (None: all). Judging costs most of the pass: a check of a few recipes judges only them."""
    from tests.functional_tests.recipe_check.universe import config_functions

    def judged(name: str) -> bool:
        return judge is None or name in judge or name.split(".", 1)[-1] in judge

    return [universe_row(name, fn, configs, judged(name)) for name, fn in config_functions().items()]


def arm_config(model, arm: str, keywords: dict, data: int, delay_wgrad: bool = True):
    """The ``ConfigContainer`` one arm trains: the shrunk provider in the stock loop's small config; the hook arm
    with the README's recipe lines (``--moe_a2a_overlap true``: overlap and delayed wgrad)."""
    from tests.functional_tests.bridge_config import small_config
    from tests.functional_tests.recipe_check.verdicts import STEPS
    from tests.functional_tests.stock_bridge_loop import MICRO_BATCH, MICROBATCHES, SEQ, VOCAB

    model = copy.deepcopy(model)
    # Megatron-Core's interleaved schedule wants the microbatches in whole groups of the pipeline's size
    microbatches = (
        2 * model.pipeline_model_parallel_size if model.virtual_pipeline_model_parallel_size else MICROBATCHES
    )
    cfg = small_config(model, steps=STEPS, global_batch=MICRO_BATCH * microbatches * data, micro_batch=MICRO_BATCH,
                       seq=SEQ, vocab=VOCAB, lr=1e-2, bf16_optimizer=False, clip_grad=0.0, grad_reduce_in_fp32=False,
                       dist={"distributed_backend": "gloo"})  # fmt: skip
    if arm == "plain":
        return cfg
    from megatron.bridge.training.ep_overlap.mcore import use_ep_overlap_schedule
    from megatron.bridge.training.ep_overlap_config import EPOverlapCommOverlapConfig

    cfg.comm_overlap = EPOverlapCommOverlapConfig(
        tp_comm_overlap=False, overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=delay_wgrad
    )
    cfg.model.register_pre_wrap_hook(functools.partial(use_ep_overlap_schedule, **keywords))
    if "full_recompute" in keywords:  # the hook sets it on the built config (the fix our rule names)
        cfg.model.recompute_granularity = cfg.model.recompute_method = cfg.model.recompute_num_layers = None
    return cfg


def rank_main(rank: int, world: int, model, keywords: dict, data: int, delay_wgrad: bool) -> dict:
    from tests.functional_tests.recipe_check.cpu import family_of, install_rank_stand_ins
    from tests.functional_tests.recipe_check.verdicts import STEPS
    from tests.functional_tests.stock_bridge_loop import bridge_train
    from tests.functional_tests.vl_bridge_loop import bridge_train_vl
    from tests.unit_tests.training.ep_overlap.mcore_cpu import install_cpu_stubs

    install_cpu_stubs()
    install_rank_stand_ins(model)
    vision_language = family_of(model) == "vision_language"
    out = {}
    for arm in ("hook", "plain"):  # a refusal first: it needs no plain arm (which may not build here)
        try:
            cfg = arm_config(model, arm, keywords, data, delay_wgrad)
            out[arm] = bridge_train_vl(cfg, STEPS) if vision_language else bridge_train(cfg, STEPS, mask_every=3)
        except Exception as error:  # the verdict reads it
            from megatron.bridge.training.moe_overlap_rules import CommOverlapConfigError

            refused = isinstance(error, CommOverlapConfigError) or (
                isinstance(error, ValueError) and "fix" in str(error)
            )
            out[arm] = {"error": str(error).strip().splitlines()[-1] if not refused else str(error),
                        "refused": refused and arm == "hook", "trace": traceback.format_exc()[-2000:]}  # fmt: skip
            return out
    return out


def check(name: str, patched: bool, configs, delay_wgrad: bool = True) -> dict:
    """One recipe's CPU run: its row."""
    from ep_overlap_lab.multiprocess import run_local_ranks
    from tests.functional_tests.recipe_check.universe import config_functions
    from tests.functional_tests.recipe_check.verdicts import verdict

    row = {"recipe": name}
    try:
        cfg = config_functions()[name]()
        run = prepared(cfg)
    except Exception as error:
        why, limit = built_error(error, configs)
        return row | {"verdict": "not checked" if limit else "failed", "why": why,
                      "trace": traceback.format_exc()[-2000:], "config": list(configs.used)}  # fmt: skip
    row |= {"shape": describe(cfg.model), "ranks": run["shape"]["world"], "config": list(configs.used),
            "substituted": run["substituted"]}  # fmt: skip
    from megatron.bridge.training.ep_overlap.mcore.refusals import config_refusals

    refusals = config_refusals(cfg.model)
    if refusals:  # the plan refuses it when built, on every rank, before any step: decided from the config alone
        names = ", ".join(sorted({name for name, _ in refusals}))
        return row | {"verdict": "refused", "why": f"{names} (the plan's, decided from the config; not run)"}
    if run["patched"] and not patched:
        return row | {"needs_patch": True}
    if not delay_wgrad:
        row["substituted"].append("delayed wgrad off (asked)")
    shape = run["shape"]
    outcomes = run_local_ranks(rank_main, shape["world"], (cfg.model, run["keywords"], shape["data"], delay_wgrad),
                               collective_timeout_s=120, raise_on_error=False)  # fmt: skip
    failed = [o for o in outcomes if o.error is not None]
    if failed:
        return row | {"verdict": "failed", "why": str(failed[0].error).strip().splitlines()[-1]}
    return row | verdict([o.result for o in outcomes])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tree", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--universe", action="store_true")
    parser.add_argument("--judge", nargs="*", help="with --universe: judge only these names (bare or qualified)")
    parser.add_argument("--recipe")
    parser.add_argument("--recipes", nargs="+", help="several CPU runs in this process, one JSON line each in OUT")
    parser.add_argument("--patched", action="store_true", help="TREE is Bridge 0.6.2 with this project's patch")
    parser.add_argument("--no_delay_wgrad", action="store_true", help="the overlap without delayed wgrad")
    args = parser.parse_args()
    from tests.functional_tests.recipe_check.offline import install

    configs = install(args.tree)
    if args.recipes:  # the imports paid once; each row written as it is done (a crash loses only the one running)
        with args.out.open("a") as out:
            for name in args.recipes:
                configs.clear()
                row = check(name, args.patched, configs, not args.no_delay_wgrad)
                out.write(json.dumps(row) + "\n")
                out.flush()
        return
    if args.universe:
        result = universe_rows(configs, args.judge)
    else:
        result = check(args.recipe, args.patched, configs, not args.no_delay_wgrad)
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    sys.path.insert(1, str(ROOT))  # the tests' CPU stand-ins; never src/, which the tree stands for
    main()
