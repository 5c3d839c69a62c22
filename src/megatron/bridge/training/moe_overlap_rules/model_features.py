"""Model features this project's plan does not schedule: refused by name, where Megatron-Core's own forward would act
on them and the plan would not (the field audit, ``tests/.../test_config_fields.py``, finds them)."""

from megatron.bridge.training.moe_overlap_rules.facts import Rule, bridge_schedule, delay_wgrad_on

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
        "latent_moe_delayed_wgrad",
        ("model.moe_latent_size", "comm_overlap.delay_wgrad_compute"),
        lambda f: bridge_schedule(f) and delay_wgrad_on(f),
        lambda f: f["model.moe_latent_size"] is None,
        "the plan runs the MoE latent projections where the plain path does (preprocess, postprocess: bitwise), but "
        "with delayed wgrad Megatron-Core's MoE layer runs the output projection's deferred weight gradient on the "
        "communication stream of its own combined-1F1B driver, which this project's schedule neither uses nor orders "
        "with its compute stream. Supporting it takes the plan running both projections' backward_dw on its own "
        "streams, and a GPU test with Transformer Engine.",
        f"set delay_wgrad_compute=False (or moe_latent_size=None), {_OFF}",
    ),
)
