"""Model features this project's plan does not schedule: refused by name, where Megatron-Core's own forward would act
on them and the plan would not (the field audit, ``tests/.../test_config_fields.py``, finds them)."""

from megatron.bridge.training.moe_overlap_rules.facts import Rule, bridge_schedule

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
        "paged_stash",
        ("model.moe_paged_stash",),
        bridge_schedule,
        lambda f: not f["model.moe_paged_stash"],
        "paged stash pages the routed experts' activations out in the forward's order and back in the backward's, "
        "advanced by the model's forward (which the plan does not call) for one microbatch at a time, while the "
        "schedule interleaves two microbatches' layers.",
        f"set moe_paged_stash=False, {_OFF}",
    ),
    Rule(
        "activation_offloading",
        ("model.fine_grained_activation_offloading", "model.cpu_offloading"),
        bridge_schedule,
        lambda f: not (f["model.fine_grained_activation_offloading"] or f["model.cpu_offloading"]),
        "activation offloading is driven by the model's and the block's forward (its groups started per microbatch "
        "and committed per layer there), which the plan replaces with its own nodes.",
        f"set fine_grained_activation_offloading=False and cpu_offloading=False, {_OFF}",
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
    Rule(
        "latent_moe",
        ("model.moe_latent_size",),
        bridge_schedule,
        lambda f: f["model.moe_latent_size"] is None,
        "the MoE latent projections are Transformer Engine linears only, and this project's plan has not run them "
        "yet (no test has: they need a GPU with Transformer Engine), so it does not claim them.",
        f"set moe_latent_size=None, {_OFF}",
    ),
)
