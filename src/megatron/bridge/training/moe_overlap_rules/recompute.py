"""Recompute with the overlap: refused by Megatron-Core's own schedule, replayed by this project's (segments);
with low precision, only current-scaling fp8 replays the first forward's quantization."""

from megatron.bridge.training.moe_overlap_rules.facts import (
    MCORE_FULL_RECOMPUTE,
    MODEL_BUILT,
    RECOMPUTE_MODULES,
    SCHEDULE,
    SPELLED,
    WGRAD_WINDOW,
    Rule,
    bridge_schedule,
    fp8_recipe,
    full_recompute,
    mcore_schedule,
)


def names_segments(f) -> bool:
    """Full recompute cut into segments by this project's code, with or without the overlap: its fields say how."""
    return f[SCHEDULE] != "mcore" and f["model.recompute_granularity"] == "full"


RECOMPUTE_RULES: tuple[Rule, ...] = (
    Rule(
        "no_full_recompute",
        ("model.recompute_granularity", SCHEDULE),
        mcore_schedule,
        lambda f: f["model.recompute_granularity"] != "full",
        "full recompute re-runs whole layers and breaks the paired layer schedule: disable full recomputation. "
        f"Megatron-Core {MCORE_FULL_RECOMPUTE}'s own overlapped schedule refuses it (its TransformerConfig asserts "
        "this); this project's schedule replays it.",
        "set recompute_granularity=None (or 'selective' without 'moe'), or run this project's schedule, which "
        "replays it: register use_ep_overlap_schedule with cfg.model.register_pre_wrap_hook before setup.",
    ),
    Rule(
        "no_recompute_method",
        ("model.recompute_method", SCHEDULE),
        mcore_schedule,
        lambda f: f["model.recompute_method"] is None,
        "a recompute method implies layer recompute, which EP overlap does not support: disable recomputation method.",
        "set recompute_method=None.",
    ),
    Rule(
        "no_recompute_num_layers",
        ("model.recompute_num_layers", SCHEDULE),
        mcore_schedule,
        lambda f: f["model.recompute_num_layers"] is None,
        "recompute_num_layers must be None with EP overlap: it implies layer recompute.",
        "set recompute_num_layers=None.",
    ),
    Rule(
        "recompute_layers_need_full",
        ("model.recompute_granularity", "model.recompute_method", "model.recompute_num_layers"),
        lambda f: bridge_schedule(f) and f["model.recompute_granularity"] != "full",
        lambda f: f["model.recompute_method"] is None and f["model.recompute_num_layers"] is None,
        "recompute_method and recompute_num_layers choose the layers of full recompute, which is not asked for.",
        "set recompute_granularity='full', or recompute_method=None and recompute_num_layers=None.",
    ),
    Rule(
        "full_recompute_method",
        ("model.recompute_method",),
        names_segments,
        lambda f: f["model.recompute_method"] in ("uniform", "block"),
        "full recompute replays 'uniform' segments or the first layers ('block').",
        "set recompute_method='uniform' (or 'block').",
    ),
    Rule(
        "full_recompute_num_layers",
        ("model.recompute_num_layers",),
        names_segments,
        lambda f: type(f["model.recompute_num_layers"]) is int and f["model.recompute_num_layers"] >= 1,
        "full recompute needs the layers per segment ('uniform') or the number of layers recomputed ('block').",
        "set a positive integer, e.g. recompute_num_layers=1.",
    ),
    Rule(
        "full_recompute_dropout",
        ("model.hidden_dropout", "model.attention_dropout"),
        full_recompute,
        lambda f: not f["model.hidden_dropout"] and not f["model.attention_dropout"],
        "the replay of full recompute does not restore the RNG state, so dropout would draw other masks than the "
        "first forward and change the gradients.",
        "set hidden_dropout=0.0 and attention_dropout=0.0.",
    ),
    Rule(
        "no_moe_recompute",
        (RECOMPUTE_MODULES, SCHEDULE),
        # This project's schedule replays each such layer's MoE part (the flag set after Megatron-Core's checks).
        mcore_schedule,
        lambda f: "moe" not in (f[RECOMPUTE_MODULES] or ()),
        lambda f: (
            "recomputing the MoE module conflicts with the split MoE layer nodes: disable moe in recompute_modules"
            + (" (moe_layer_recompute=True puts it there)" if RECOMPUTE_MODULES in f[SPELLED] else "")
            + "; this project's schedule replays it."
        ),
        lambda f: (
            (
                "set moe_layer_recompute=False"
                if RECOMPUTE_MODULES in f[SPELLED]
                else "remove 'moe' from recompute_modules"
            )
            + ", or run this project's schedule: register use_ep_overlap_schedule with "
            "cfg.model.register_pre_wrap_hook."
        ),
    ),
    Rule(
        "full_recompute_wgrad_window",
        (WGRAD_WINDOW, "model.recompute_method"),
        lambda f: full_recompute(f) and f["model.recompute_method"] == "uniform",
        lambda f: f[WGRAD_WINDOW] != 2,
        "with every layer replayed (full recompute, 'uniform'), each layer step runs B's delayed attention wgrad "
        "beside its combine backward (window 1's place); window 2 would change nothing.",
        "set attention_wgrad_window=1 (or None).",
    ),
    Rule(
        "full_recompute_mtp",
        ("model.recompute_method", "model.recompute_num_layers", "model.mtp_num_layers"),
        lambda f: full_recompute(f) and bool(f["model.mtp_num_layers"]) and f["model.recompute_method"] == "uniform",
        lambda f: f["model.recompute_num_layers"] == 1,
        "with recompute_method='uniform' and an MTP layer, Megatron-Core checkpoints the MTP depth as one segment "
        "only with recompute_num_layers=1 (its MTP layer asserts it in its first forward, on the last stage only).",
        "set recompute_num_layers=1, or recompute_method='block'.",
    ),
    Rule(
        "full_recompute_in_the_recipe",
        ("model.recompute_granularity", MODEL_BUILT),
        lambda f: full_recompute(f) and not f[MODEL_BUILT],
        lambda f: False,
        "Megatron-Core's TransformerConfig asserts 'disable full recomputation when enabling "
        "overlap_moe_expert_parallel_comm' when Megatron-Bridge builds the model config (cfg.validate()), before "
        "this project's schedule, which replays full recompute, is installed.",
        "leave recompute_granularity, recompute_method and recompute_num_layers unset in the recipe and give them "
        "to the hook, which sets them on the built config: "
        "partial(use_ep_overlap_schedule, full_recompute=('uniform', 1)).",
    ),
)


QUANTIZATION_RULES: tuple[Rule, ...] = (
    Rule(
        "fp8_delayed_full_recompute",
        ("model.fp8", "model.fp8_recipe", "model.recompute_granularity"),
        lambda f: full_recompute(f) and bool(f["model.fp8"]),
        lambda f: fp8_recipe(f) != "delayed",
        "delayed-scaling fp8 takes each forward's scales from an amax history the step keeps updating, and the "
        "replay of full recompute runs after later forwards updated it, so the replayed GEMMs would quantize with "
        "other scales than the first forward (Megatron-Core's dev line refuses it too).",
        "set fp8_recipe='tensorwise', 'blockwise' or 'mxfp8' (current scaling), or recompute_granularity='selective'.",
    ),
)
