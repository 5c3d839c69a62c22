"""One Megatron-Bridge 0.6.2 recipe, shrunk to CPU size, trained 2 steps by Bridge's own loop with the overlap off and
on (run by ``tools/recipe_check.py`` in the stock-Bridge scratch interpreter; test-only stand-ins, never product).

    python recipe_check_worker.py TREE OUT.json --list [--all]     the recipe functions (or those --all checks)
    python recipe_check_worker.py TREE OUT.json --recipe NAME [--patched]   one row: shape, substitutions, verdict

What runs, in order:

1. **The recipe as a user builds it.** ``megatron.bridge.recipes`` imports every recipe; on a host without the hub or
   ``diffusers``: the flux recipes' ``diffusers`` imports get empty modules, and ``AutoConfig.from_pretrained`` gives
   ``AutoConfig.for_model`` of the model's type (``transformers``' defaults, which mirror the published checkpoint),
   from :data:`CONFIG_SOURCES`; the row names that source. A recipe that asks the GPU which flex dispatcher backend
   it takes sees an H100's device properties. The recipe function then runs unchanged.
2. **The overlap on, as Bridge's performance scripts' ``--moe_a2a_overlap true`` does:** the overlap flag and delayed
   wgrad on, ``moe_shared_expert_overlap`` off; with this project's config class and pre-wrap hook (the README's
   recipe lines). Full recompute set by the recipe moves to the hook's ``full_recompute`` keyword, the fix our rule
   names (Megatron-Core 0.19's config refuses it with the flag).
3. **Shrunk, structure kept** (:func:`shrink`): every parallel size above 1 becomes 2 (virtual stages too), the data-
   parallel size the smallest that the expert grid allows; layers: 2 per pipeline chunk, a leading dense layer kept
   where the recipe has leading dense layers; widths small, the GQA ratio kept; MLA, shared experts, MTP, biases,
   windows and the router's groups kept in small sizes.
4. **CPU substitutions, named in the row** (:func:`on_cpu`): bf16 weights (fp8/fp4 recipes drop to it), Megatron-Core's
   local layer spec (with the tests' sequence-parallel norms and context-parallel attention where the layout needs
   them), the alltoall dispatcher for ``flex``, no fused kernels, no CUDA graphs, no TP comm overlap.
5. **Bridge's ``train()``**, 2 steps per arm on gloo ranks (``stock_bridge_loop.bridge_train``), then the verdict:
   ``bitwise``, ``refused`` (our rules' names, or the hook's line), ``differs`` (the first tensor), ``failed`` (the
   error's last line).
"""

import argparse
import copy
import importlib.abc
import importlib.machinery
import inspect
import json
import math
import re
import sys
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2

# Hugging Face model ids (lower case, a part of the id) -> the transformers config type that stands for the hub's.
CONFIG_SOURCES = {
    "qwen3-30b-a3b": "qwen3_moe",
    "qwen3-235b-a22b": "qwen3_moe",
    "qwen3-next": "qwen3_next",
    "qwen3-vl": "qwen3_vl_moe",
    "gpt-oss": "gpt_oss",
    "moonlight": "deepseek_v3",
    "deepseek-v3": "deepseek_v3",
    "deepseek-v2": "deepseek_v2",
    "glm-4.5": "glm4_moe",
    "olmoe": "olmoe",
    "nemotron-3-nano": "nemotron_h",
    "minimax-m2": "minimax_m2",
}
SOURCES_USED: list[str] = []


class _AnyModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


class _EmptyDiffusers(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``diffusers`` and its submodules as empty modules: only the flux recipes import it, to build what no check
    builds."""

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] != "diffusers":
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        return _AnyModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def _offline_config(cls, name, *args, **kwargs):
    import transformers
    from transformers.models.auto import modeling_auto

    key = str(name).lower()
    for part, model_type in CONFIG_SOURCES.items():
        if part in key:
            config = transformers.AutoConfig.for_model(model_type)
            heads = (
                modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
            )
            config.architectures = [next(head[model_type] for head in heads if model_type in head)]
            SOURCES_USED.append(f"{name} -> transformers AutoConfig.for_model({model_type!r})")
            return config
    raise OSError(f"no offline config for {name!r} (the hub is not reached; transformers has no config for it here)")


def install_stand_ins(tree: Path) -> None:
    """The real ``megatron.bridge`` package of ``tree`` (recipes import ``AutoBridge`` from its ``__init__``), empty
    ``diffusers``, offline configs."""
    import transformers

    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "_BareBridge"]
    sys.path.insert(0, str(tree))
    import torch

    # Recipes ask the GPU which flex dispatcher backend it takes (apply_flex_dispatcher_backend): built as on an H100.
    torch.cuda.get_device_properties = lambda *args: types.SimpleNamespace(
        major=9, minor=0, name="NVIDIA H100 80GB HBM3"
    )
    sys.meta_path.insert(0, _EmptyDiffusers())
    transformers.AutoConfig.from_pretrained = classmethod(_offline_config)


def recipe_functions(only_overlap: bool) -> list[str]:
    """Every recipe function ``megatron.bridge.recipes`` exports; with ``only_overlap`` those whose source sets the
    overlap flag to True or has its line commented out."""
    import megatron.bridge.recipes as recipes

    names = sorted(n for n in dir(recipes) if n.endswith("_config") and callable(getattr(recipes, n)))
    if not only_overlap:
        return names
    pattern = re.compile(r"overlap_moe_expert_parallel_comm\s*=\s*True|#\s*cfg\.comm_overlap\.overlap_moe_expert")
    return [n for n in names if pattern.search(inspect.getsource(getattr(recipes, n)))]


def overlap_on(cfg) -> dict:
    """The hook's keywords; ``cfg`` gets what ``--moe_a2a_overlap true`` sets (kept for the check's hook arm)."""
    model = cfg.model
    keywords = {"attention_wgrad_window": 1}
    if model.recompute_granularity == "full":
        keywords["full_recompute"] = (model.recompute_method, model.recompute_num_layers)
    model.moe_shared_expert_overlap = False
    return keywords


def _layers(model, stages: int) -> tuple[int, object]:
    """2 layers per pipeline chunk and the MoE pattern: a leading dense layer where the recipe has any."""
    count = 2 * stages
    freq = model.moe_layer_freq
    if isinstance(freq, list | tuple):
        lead = 1 if freq and freq[0] == 0 else 0
        return count, [0] * lead + [1] * (count - lead)
    return count, freq if isinstance(freq, int) and freq <= count else 1


def shrink(model) -> dict:
    """``model`` (the recipe's provider) at CPU size, in place; returns the shape it will run."""
    sizes = {}
    for field in ("tensor", "pipeline", "context", "expert", "expert_tensor"):
        name = (
            f"{field}_model_parallel_size" if field in ("tensor", "pipeline", "expert") else f"{field}_parallel_size"
        )
        sizes[field] = min(getattr(model, name) or 1, 2)
        setattr(model, name, sizes[field])
    vpp = 2 if model.virtual_pipeline_model_parallel_size else None
    model.virtual_pipeline_model_parallel_size = vpp
    grid = sizes["expert"] * sizes["expert_tensor"]
    data = grid // math.gcd(sizes["tensor"] * sizes["context"], grid)
    world = sizes["tensor"] * sizes["context"] * sizes["pipeline"] * data
    model.num_layers, model.moe_layer_freq = _layers(model, sizes["pipeline"] * (vpp or 1))
    pattern = getattr(model, "hybrid_layer_pattern", None)
    if pattern:  # a hybrid stack: the shortest start of the pattern that has every kind of layer it has
        kinds = set(pattern.replace("|", ""))
        start = next(n for n in range(1, len(pattern) + 1) if set(pattern[:n].replace("|", "")) == kinds)
        model.hybrid_layer_pattern = pattern[:start].replace("|", "")
        model.num_layers = len(model.hybrid_layer_pattern)
    for name in ("pipeline_model_parallel_layout", "num_layers_in_first_pipeline_stage",
                 "num_layers_in_last_pipeline_stage"):  # fmt: skip
        setattr(model, name, None)
    ratio = model.num_attention_heads // (model.num_query_groups or model.num_attention_heads)
    model.num_query_groups = sizes["tensor"]
    model.num_attention_heads = sizes["tensor"] * ratio
    model.hidden_size, model.kv_channels, model.ffn_hidden_size, model.moe_ffn_hidden_size = 32, 8, 48, 16
    if model.moe_shared_expert_intermediate_size:
        model.moe_shared_expert_intermediate_size = 16
    model.num_moe_experts = 2 * sizes["expert"]
    model.moe_router_topk = min(model.moe_router_topk, 2)
    if getattr(model, "moe_router_num_groups", None):
        model.moe_router_num_groups, model.moe_router_group_topk = 2, 1
    if getattr(model, "multi_latent_attention", False):
        for name, value in dict(q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8,
                                v_head_dim=8).items():  # fmt: skip
            if name != "q_lora_rank" or getattr(model, name) is not None:
                setattr(model, name, value)
    if getattr(model, "window_size", None):
        model.window_size = (min(model.window_size[0], 3), model.window_size[1])
    from tests.functional_tests.stock_bridge_loop import SEQ, VOCAB

    model.seq_length, model.vocab_size, model.make_vocab_size_divisible_by = SEQ, VOCAB, VOCAB
    shape = {k: v for k, v in sizes.items() if v > 1} | ({"virtual": vpp} if vpp else {})
    return {"world": world, "data": data, "sizes": shape, "layers": model.num_layers, "freq": model.moe_layer_freq}


_FUSIONS = ("moe_grouped_gemm", "moe_permute_fusion", "moe_router_fusion", "gradient_accumulation_fusion",
            "persist_layer_norm", "masked_softmax_fusion", "apply_rope_fusion", "bias_dropout_fusion",
            "bias_activation_fusion", "cross_entropy_loss_fusion")  # fmt: skip


def on_cpu(cfg) -> list[str]:
    """The CPU substitutions, in place; returns them as the row's words."""
    import torch

    model, said = cfg.model, []
    precision = getattr(cfg.mixed_precision, "name", cfg.mixed_precision) or ("bf16" if model.bf16 else "fp32")
    if model.fp8 or getattr(model, "fp4", None) or "bf16" not in str(precision):
        said.append(f"precision {precision} -> bf16")
    cfg.mixed_precision = None
    model.fp8 = model.fp4 = None
    model.bf16, model.fp16, model.params_dtype = True, False, torch.bfloat16
    model.pipeline_dtype = torch.bfloat16 if model.pipeline_model_parallel_size > 1 else None
    if model.moe_token_dispatcher_type == "flex":
        said.append(f"dispatcher flex ({model.moe_flex_dispatcher_backend}) -> alltoall")
        model.moe_token_dispatcher_type = "alltoall"
    model.transformer_layer_spec = recipe_spec
    model.transformer_impl = "local"
    if getattr(model, "mtp_num_layers", None):
        import megatron.bridge.models.gpt_provider as gpt_provider

        gpt_provider.mtp_block_spec = local_mtp_block_spec  # in this worker process only
        said.append("MTP block -> local modules")
    said.append("layer spec -> Megatron-Core local" + (", SP norms" if model.sequence_parallel else ""))
    if model.context_parallel_size > 1:
        said.append("attention -> tests' context-parallel attention")
    if getattr(cfg, "peft", None) is not None:
        said.append(f"{type(cfg.peft).__name__} not applied (full weights train)")
    for name in _FUSIONS:
        if hasattr(model, name):
            setattr(model, name, False)
    if "moe_act" in (model.recompute_modules or []):  # Megatron-Core recomputes it only inside grouped GEMMs
        model.recompute_modules = [m for m in model.recompute_modules if m != "moe_act"]
        said.append("recompute of moe_act dropped (it needs grouped GEMMs)")
    if model.cuda_graph_impl not in (None, "none"):
        said.append(f"CUDA graphs {model.cuda_graph_impl} -> none")
    model.cuda_graph_impl = "none"
    model.use_cpu_initialization, model.batch_p2p_comm = True, False
    model.attention_dropout = model.hidden_dropout = 0.0
    return said


def recipe_spec(config, vp_stage=None):
    """Megatron-Core's local decoder block spec (MLA's core attention made to build), with the tests' norms that
    take sequence parallelism and attention that takes context parallelism where the layout has them."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from tests.unit_tests.training.ep_overlap.cp_attention import with_context_parallel_attention
    from tests.unit_tests.training.ep_overlap.mcore_models import local_mla_core_attention
    from tests.unit_tests.training.ep_overlap.sp_norm import with_sequence_parallel_norms

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)
    if config.multi_latent_attention:
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = local_mla_core_attention()
    if config.context_parallel_size > 1:
        with_context_parallel_attention(spec)
    return with_sequence_parallel_norms(spec) if config.sequence_parallel else spec


def local_mtp_block_spec(config, vp_stage=None):
    """Bridge's ``gpt_provider.mtp_block_spec`` with Megatron-Core's local modules (Bridge's asks for Transformer
    Engine's), its norms taking sequence parallelism where the layout has it."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    from tests.unit_tests.training.ep_overlap.sp_norm import SequenceParallelNorm

    if not getattr(config, "mtp_num_layers", None):
        return None
    layers = recipe_spec(config, vp_stage).layer_specs
    if not layers:  # a stage without decoder layers: the last layer's kind, as Bridge derives it
        layers = recipe_spec(config, None).layer_specs
    block = get_gpt_mtp_block_spec(config, layers[-1], use_transformer_engine=False, vp_stage=vp_stage)
    for layer in block.layer_specs if block is not None and config.sequence_parallel else ():  # None: no MTP here
        for name in ("enorm", "hnorm", "layer_norm"):
            if getattr(layer.submodules, name, None) is not None:
                setattr(layer.submodules, name, SequenceParallelNorm)
    return block


def arm_config(model, arm: str, keywords: dict, data: int, delay_wgrad: bool = True):
    """The ``ConfigContainer`` one arm trains: the shrunk provider in the stock loop's small config; the hook arm
    with the README's recipe lines (``--moe_a2a_overlap true``: overlap and delayed wgrad)."""
    from functools import partial

    from tests.functional_tests.bridge_config import small_config
    from tests.functional_tests.stock_bridge_loop import MICRO_BATCH, MICROBATCHES, SEQ, VOCAB

    model = copy.deepcopy(model)
    cfg = small_config(model, steps=STEPS, global_batch=MICRO_BATCH * MICROBATCHES * data, micro_batch=MICRO_BATCH,
                       seq=SEQ, vocab=VOCAB, lr=1e-2, bf16_optimizer=False, clip_grad=0.0, grad_reduce_in_fp32=False,
                       dist={"distributed_backend": "gloo"})  # fmt: skip
    if arm == "plain":
        return cfg
    from megatron.bridge.training.ep_overlap.mcore import use_ep_overlap_schedule
    from megatron.bridge.training.ep_overlap_config import EPOverlapCommOverlapConfig

    cfg.comm_overlap = EPOverlapCommOverlapConfig(
        tp_comm_overlap=False, overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=delay_wgrad
    )
    cfg.model.register_pre_wrap_hook(partial(use_ep_overlap_schedule, **keywords))
    if "full_recompute" in keywords:  # the hook sets it on the built config (the fix our rule names)
        cfg.model.recompute_granularity = cfg.model.recompute_method = cfg.model.recompute_num_layers = None
    return cfg


def rank_main(rank: int, world: int, model, keywords: dict, data: int, delay_wgrad: bool) -> dict:
    from tests.functional_tests.stock_bridge_loop import bridge_train
    from tests.unit_tests.training.ep_overlap.mcore_cpu import install_cpu_stubs

    install_cpu_stubs()
    out = {}
    for arm in ("plain", "hook"):
        try:
            out[arm] = bridge_train(arm_config(model, arm, keywords, data, delay_wgrad), STEPS, mask_every=3)
        except Exception as error:  # the verdict reads it
            from megatron.bridge.training.moe_overlap_rules import CommOverlapConfigError

            refused = isinstance(error, CommOverlapConfigError) or (
                isinstance(error, ValueError) and "fix" in str(error)
            )
            out[arm] = {"error": str(error).strip().splitlines()[-1] if not refused else str(error),
                        "refused": refused and arm == "hook", "trace": traceback.format_exc()[-2000:]}  # fmt: skip
            return out
    return out


def verdict(ranks: list[dict]) -> dict:
    """``bitwise``, ``refused`` (rule names), ``differs`` (the first tensor) or ``failed`` (the error line)."""
    return (
        _first_error(ranks)
        or _first_difference(ranks)
        or {
            "verdict": "bitwise",
            "why": f"{STEPS} steps, losses, gradients and parameters on {len(ranks)} ranks",
        }
    )


_SECONDARY = ("by peer", "imed out", "Timeout")  # words of a rank's error that follows another rank's failure


def _first_error(ranks: list[dict]) -> dict | None:
    """The refusal or failure of the first rank and arm that raised; a peer's lost connection or timeout, which
    follows another rank's failure, only when there is nothing else."""
    raised = [(rank, arm, arms[arm]) for rank, arms in enumerate(ranks) for arm in ("plain", "hook")
              if "error" in arms.get(arm, {})]  # fmt: skip
    for rank, arm, run in sorted(raised, key=lambda r: any(w in r[2]["error"] for w in _SECONDARY)):
        if run.get("refused"):
            rules = sorted(set(re.findall(r"\[([a-z0-9_]+)\]", run["error"])))
            return {"verdict": "refused", "why": ", ".join(rules) or run["error"].splitlines()[-1]}
        return {"verdict": "failed", "why": f"{arm} arm, rank {rank}: {run['error']}", "trace": run["trace"]}
    return None


def _first_difference(ranks: list[dict]) -> dict | None:
    """Where the hook arm's record first differs from the plain arm's (each step's losses, gradients and parameters
    are dicts by name), or the hook arm did not run this project's plan."""
    for rank, arms in enumerate(ranks):
        plain, hook = arms["plain"], arms["hook"]
        if not hook["overlap_flag"] or hook["plan"] != "EPOverlapPlanBuilder" or not hook["dispatches"]:
            return {"verdict": "failed", "why": "the hook arm did not run this project's plan"}
        for step in range(STEPS):
            for what in ("losses", "grads", "params"):
                mine, theirs = plain[what][step], hook[what][step]
                for name in sorted(mine.keys() | theirs.keys()):
                    if mine.get(name) != theirs.get(name):
                        return {"verdict": "differs", "why": f"rank {rank} step {step} {what} {name}"}
    return None


def check(name: str, patched: bool, delay_wgrad: bool = True) -> dict:
    """One recipe's row."""
    import megatron.bridge.recipes as recipes

    from megatron.bridge.utils.multiprocess import run_local_ranks

    row = {"recipe": name}
    try:
        cfg = getattr(recipes, name)()
        keywords = overlap_on(cfg)
        row["recipe_shape"] = describe(cfg.model)
        shape = shrink(cfg.model)
        row["substituted"] = on_cpu(cfg)
    except Exception as error:
        return row | {"verdict": "failed", "why": f"building: {str(error).strip().splitlines()[-1]}",
                      "trace": traceback.format_exc()[-2000:], "config": SOURCES_USED}  # fmt: skip
    if "full_recompute" in keywords:
        row["substituted"].append("full recompute -> the hook's full_recompute keyword")
    row |= {"shape": describe(cfg.model), "ranks": shape["world"], "config": SOURCES_USED}
    model = cfg.model
    if model.pipeline_model_parallel_size > 1 and not model.virtual_pipeline_model_parallel_size:
        if not patched:  # the plain 1F1B pipeline needs this project's patch to Bridge's train()
            return row | {"needs_patch": True}
        row["substituted"].append("Bridge's train() patched (PP without VPP needs it)")
    if not delay_wgrad:
        row["substituted"].append("delayed wgrad off (asked)")
    outcomes = run_local_ranks(rank_main, shape["world"], (cfg.model, keywords, shape["data"], delay_wgrad),
                               collective_timeout_s=120, raise_on_error=False)  # fmt: skip
    failed = [o for o in outcomes if o.error is not None]
    if failed:
        return row | {"verdict": "failed", "why": str(failed[0].error).strip().splitlines()[-1]}
    return row | verdict([o.result for o in outcomes])


def describe(model) -> str:
    """The layout and the layer structure, in a few words."""
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
    words = {"multi_latent_attention": "MLA", "mtp_num_layers": "MTP",
             "moe_shared_expert_intermediate_size": "shared experts", "add_bias_linear": "biases"}  # fmt: skip
    for flag, word in words.items():
        if getattr(model, flag, None):
            parts.append(word)
    return " ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tree", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--all", action="store_true")
    parser.add_argument("--recipe")
    parser.add_argument("--patched", action="store_true", help="TREE is Bridge 0.6.2 with this project's patch")
    parser.add_argument("--no_delay_wgrad", action="store_true", help="the overlap without delayed wgrad")
    args = parser.parse_args()
    install_stand_ins(args.tree)
    if args.list:
        result = {"all": recipe_functions(False), "overlap": recipe_functions(True)}
    else:
        result = check(args.recipe, args.patched, not args.no_delay_wgrad)
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    sys.path.insert(1, str(ROOT))  # the tests' CPU stand-ins; never src/, which the tree stands for
    main()
