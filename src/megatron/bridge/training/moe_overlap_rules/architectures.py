"""Layer features of Megatron-Bridge 0.6.2's newer MoE families that this project's plan does not run: refused by name
when the plan is built (and at a recipe's setup), never trained with a part skipped.

Contract:
    * Each row names the config field, the family that sets it, what the plan would leave out or get wrong, and the
      fix; what supporting the feature would take is part of the message. They apply where this project's schedule
      runs the layers (``bridge_schedule``); Megatron-Core's own schedule makes its own checks.
    * The fields are read by attribute (``facts._MODEL_FIELDS``): Megatron-Bridge's providers carry DeepSeek-V4's
      fields as attributes, though Megatron-Core 0.19's ``TransformerConfig`` does not declare them.
    * Features of these families the plan does run (DSA layers, latent MoE without delayed wgrad, top-k sharing
      without full recompute, ...) are bitwise-tested in ``tests/.../test_new_families.py``.
"""

from megatron.bridge.training.moe_overlap_rules.facts import Rule, bridge_schedule, full_recompute

_OFF = "or turn overlap_moe_expert_parallel_comm off."
# The attention variants of Megatron-Core 0.19, each run under the plan by the attention module's own forward.
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
        "dsa_topk_sharing_recompute",
        ("model.dsa_indexer_topk_freq", "model.recompute_granularity"),
        lambda f: full_recompute(f) and f["model.experimental_attention_variant"] == "dsa",
        lambda f: (f["model.dsa_indexer_topk_freq"] or 1) <= 1,
        "DSA layers that reuse an earlier layer's top-k (dsa_indexer_topk_freq > 1, GLM-5.2) read it from a holder "
        "on the microbatch's attention mask, or on the model config where there is none (Megatron-Bridge's GPT step "
        "passes none), which each forward writes; in the overlapped schedule full recompute's replays run between "
        "another microbatch's layers, so a replayed layer would read that microbatch's top-k (Megatron-Core 0.19's "
        "own checkpoint loses a holder kept on a mask). Supporting it takes a holder per microbatch that its replays "
        "read too. Without full recompute the sharing is bitwise.",
        f"drop full recompute (or set dsa_indexer_topk_freq=1), {_OFF}",
    ),
)
