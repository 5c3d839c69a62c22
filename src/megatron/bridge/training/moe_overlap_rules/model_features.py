"""Model features and newer families' layer features that Megatron-Core's own forward acts on and this project's
plan does not run: refused by name, never trained with a part skipped; each message says what support would take."""

from megatron.bridge.training.moe_overlap_rules.facts import (
    Rule,
    bridge_schedule,
    full_recompute,
)

_OFF = "or turn overlap_moe_expert_parallel_comm off."

MODEL_FEATURE_RULES: tuple[Rule, ...] = (
    Rule(
        "mlp_chunks",
        ("model.mlp_chunks_for_training",),
        bridge_schedule,
        lambda f: (f["model.mlp_chunks_for_training"] or 1) == 1,
        "the plain forward runs each MoE layer once per sequence chunk (a dispatch and a combine per chunk), while "
        "the overlapped schedule dispatches whole microbatches, so the MoE layers would compute otherwise.",
        f"set mlp_chunks_for_training=1, {_OFF}",
    ),
    Rule(
        "activation_offloading",
        ("model.cpu_offloading",),
        bridge_schedule,
        lambda f: not f["model.cpu_offloading"],
        "cpu_offloading is Transformer Engine's layer-level offload context, which the stack's forward enters around "
        "each layer; the plan runs each layer's steps as its own nodes, not the stack's forward (nor does "
        "Megatron-Core's plan). Supporting it takes the plan entering that context per layer, and a GPU test.",
        "set cpu_offloading=False (fine_grained_activation_offloading=True with offload_modules offloads under the "
        f"plan, driven as Megatron-Core's plan drives it), {_OFF}",
    ),
    Rule(
        "offloading_full_recompute",
        ("model.fine_grained_activation_offloading", "model.recompute_granularity"),
        full_recompute,
        lambda f: not f["model.fine_grained_activation_offloading"],
        "fine-grained activation offloading with full recompute: Megatron-Core's plan refuses full recompute, and "
        "its plain path fails with both on (an offload group frees the layer input its checkpoint replays from: the "
        "ranks crash in this project's CPU run), so there is no run to be bitwise equal to. Supporting it takes "
        "Megatron-Core keeping that input for the replay, then the plan's replays tested against the plain path.",
        "recompute selectively (DeepSeek-V3's recipes: recompute_modules=['layernorm', 'mla_up_proj']), or set "
        f"fine_grained_activation_offloading=False, {_OFF}",
    ),
    Rule(
        "early_attention_release",
        ("model.ep_overlap_early_attn_memory_release",),
        bridge_schedule,
        lambda f: not f["model.ep_overlap_early_attn_memory_release"],
        "ep_overlap_early_attn_memory_release reorders Megatron-Core's own layer step; this project's schedule has "
        "its own order, in which B's attention backward runs beside F's combine (the planner states what it holds).",
        "set ep_overlap_early_attn_memory_release=False, or run Megatron-Core's own schedule (no pre-wrap hook).",
    ),
)


# Megatron-Core 0.19's attention variants; the plan runs each through the attention module's own forward.
_KNOWN_VARIANTS = (None, "gated_delta_net", "dsa")


def _unknown_variant(f) -> str:
    return (
        "the plan is tested with Megatron-Core 0.19's attention variants (gated_delta_net, dsa), and "
        f"{f['model.experimental_attention_variant']!r} is not one of them (DeepSeek-V4's dsv4_hybrid: "
        "sliding-window, compressed and compressed-sparse attention with a compressor and an indexer per layer, and "
        "an attention sink), so no test has run it under the plan. Supporting it takes a bitwise test on a "
        "Megatron-Core that ships the variant (the plan calls the attention module whole, so its own state between "
        "layers is what to check)."
    )


ARCHITECTURE_RULES: tuple[Rule, ...] = (
    Rule(
        "hyper_connections",
        ("model.enable_hyper_connections",),
        bridge_schedule,
        lambda f: not f["model.enable_hyper_connections"],
        "hyper-connections (DeepSeek-V4) keep several residual streams per token, mixed by learned maps around each "
        "attention and MLP sublayer, while the plan's nodes carry one hidden state from the attention to the "
        "dispatch and add the MoE output to it in the layer's own residual step, so the streams would not be mixed; "
        "Megatron-Core 0.19 has no hyper-connection module to test against. Supporting them takes nodes that carry "
        "the streams (the pre-mix before attention and experts, the post-mix after the combine) and a bitwise test "
        "on a Megatron-Core that ships them.",
        f"set enable_hyper_connections=False, {_OFF}",
    ),
    Rule(
        "hash_routing",
        ("model.moe_n_hash_layers",),
        bridge_schedule,
        lambda f: not f["model.moe_n_hash_layers"],
        "hash-routed MoE layers (DeepSeek-V4's first moe_n_hash_layers) pick experts from each token's id through "
        "a vocabulary-to-expert table (tid2eid), so their router needs the microbatch's input ids, which the plan's "
        "route step (the router on the normed hidden states) does not pass; Megatron-Core 0.19 has no hash router to "
        "test against. Supporting it takes the plan handing each hash layer's router the microbatch's token ids, as "
        "the model's forward does, and a bitwise test.",
        f"set moe_n_hash_layers=0, {_OFF}",
    ),
    Rule(
        "attention_variant",
        ("model.experimental_attention_variant",),
        bridge_schedule,
        lambda f: f["model.experimental_attention_variant"] in _KNOWN_VARIANTS,
        _unknown_variant,
        f"use an attention variant of Megatron-Core 0.19 (or none), {_OFF}",
    ),
    Rule(
        "dsa_topk_sharing_mtp_recompute",
        ("model.dsa_indexer_topk_freq", "model.recompute_granularity", "model.mtp_num_layers"),
        lambda f: full_recompute(f) and bool(f["model.mtp_num_layers"]),
        lambda f: (f["model.dsa_indexer_topk_freq"] or 1) <= 1,
        "Megatron-Core numbers the MTP layer 1, so its DSA top-k replaces decoder layer 1's in the shared holder, and "
        "the plain path's full-recompute replays of the layers reusing it read the MTP layer's top-k, not their "
        "forward's (they route otherwise than their forward did); the plan replays with their own, so the two "
        "cannot agree bitwise.",
        f"set dsa_indexer_topk_freq=1, or drop full recompute or the MTP layer, {_OFF}",
    ),
)
