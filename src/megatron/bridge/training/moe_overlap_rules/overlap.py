"""The two flags: what overlap_moe_expert_parallel_comm needs of the model and excludes, and what
delay_wgrad_compute's delayed weight gradients need."""

from megatron.bridge.training.moe_overlap_rules.facts import (
    DELAY_WGRAD,
    GRAPH_MODULES,
    NO_TE_NOTE,
    OVERLAP,
    OVERLAP_GRAD_REDUCE,
    SCHEDULE,
    TE,
    TE_AT_LEAST,
    TORCH,
    TORCH_AT_LEAST,
    Rule,
    delay_wgrad_on,
    delay_wgrad_with_te,
    field_set,
    graph_scope_needs_te_wgrad,
    overlap_on,
)

OVERLAP_RULES: tuple[Rule, ...] = (
    Rule(
        "expert_parallel",
        ("model.expert_model_parallel_size",),
        overlap_on,
        lambda f: (f["model.expert_model_parallel_size"] or 1) > 1,
        "EP overlap is only supported when expert_model_parallel_size > 1: it hides the expert-parallel all-to-all.",
        "set expert_model_parallel_size > 1, or turn overlap_moe_expert_parallel_comm off.",
    ),
    Rule(
        "moe_experts",
        ("model.num_moe_experts",),
        overlap_on,
        lambda f: (f["model.num_moe_experts"] or 0) > 1,
        "EP overlap is only supported when num_moe_experts > 1.",
        "set num_moe_experts > 1, or turn overlap_moe_expert_parallel_comm off for a dense model.",
    ),
    Rule(
        "token_dispatcher",
        ("model.moe_token_dispatcher_type",),
        overlap_on,
        lambda f: f["model.moe_token_dispatcher_type"] in ("alltoall", "flex"),
        "EP overlap is only supported when moe_token_dispatcher_type == 'alltoall' or 'flex'.",
        "set moe_token_dispatcher_type='alltoall', or call apply_flex_dispatcher_backend(model, 'deepep'|'hybridep').",
    ),
    Rule(
        "precision",
        ("model.bf16", "model.fp16", SCHEDULE),
        lambda f: f[OVERLAP] and f[SCHEDULE] == "mcore",
        lambda f: bool(f["model.bf16"] or f["model.fp16"]),
        "Megatron-Core's own overlapped schedule is only supported when using bf16 or fp16 models.",
        "set bf16=True (or fp16=True), or run this project's schedule, which takes fp32: register "
        "use_ep_overlap_schedule with cfg.model.register_pre_wrap_hook (or call use_bridge_schedule() on the model "
        "config) before setup.",
    ),
    Rule(
        "torch_version",
        (TORCH,),
        overlap_on,
        lambda f: f[TORCH_AT_LEAST]("2.6.0"),
        "EP overlap (A2A overlap) has a known hang issue with torch version < 2.6.0.",
        "upgrade PyTorch to >= 2.6.0.",
    ),
    Rule(
        "pipeline_needs_vpp",
        ("model.pipeline_model_parallel_size", "model.virtual_pipeline_model_parallel_size", SCHEDULE),
        lambda f: f[OVERLAP] and f[SCHEDULE] == "mcore" and (f["model.pipeline_model_parallel_size"] or 1) > 1,
        lambda f: f["model.virtual_pipeline_model_parallel_size"] is not None,
        "virtual_pipeline_model_parallel_size must be specified when pipeline_model_parallel_size > 1: Megatron-"
        "Core's own overlapped schedule pairs microbatches across virtual stages only.",
        "set virtual_pipeline_model_parallel_size (e.g. 2); or let this project schedule the layers, which pairs the "
        "plain 1F1B pipeline too: register use_ep_overlap_schedule (cfg.model.register_pre_wrap_hook) and take "
        "get_forward_backward_func from 'megatron.bridge.training.ep_overlap.mcore' (the patched train() does).",
    ),
    Rule(
        "no_shared_expert_overlap",
        ("model.moe_shared_expert_overlap",),
        overlap_on,
        lambda f: not f["model.moe_shared_expert_overlap"],
        "moe_shared_expert_overlap schedules shared experts on its own and conflicts with EP overlap: disable "
        "moe_shared_expert_overlap.",
        "set moe_shared_expert_overlap=False (EP overlap already hides the all-to-all).",
    ),
    Rule(
        "mtp_layers",
        ("model.mtp_num_layers", SCHEDULE),
        lambda f: f[OVERLAP] and f[SCHEDULE] == "mcore",
        lambda f: f["model.mtp_num_layers"] in (None, 0, 1),
        "with EP overlap, MTP supports at most one layer (mtp_num_layers) under Megatron-Core's own overlapped "
        "schedule, which runs the MTP layer as nodes of its layer step.",
        "set mtp_num_layers to None, 0 or 1; or let this project schedule the layers, which runs every MTP layer in "
        "its head (Megatron-Core's MTP block whole): register use_ep_overlap_schedule "
        "(cfg.model.register_pre_wrap_hook).",
    ),
    Rule(
        "no_dispatch_wgrad_overlap",
        ("model.overlap_dispatch_backward_with_experts_wgrad",),
        overlap_on,
        lambda f: not f["model.overlap_dispatch_backward_with_experts_wgrad"],
        "overlap_dispatch_backward_with_experts_wgrad is a separate, non-paired schedule.",
        "set overlap_dispatch_backward_with_experts_wgrad=False (delay_wgrad_compute gives that overlap here).",
    ),
    Rule(
        "moe_tp_needs_sp",
        ("model.tensor_model_parallel_size", "model.sequence_parallel"),
        overlap_on,
        lambda f: (f["model.tensor_model_parallel_size"] or 1) == 1 or bool(f["model.sequence_parallel"]),
        "MoE and tensor parallelism are enabled without also enabling sequence parallelism: Megatron-Core's MoE "
        "layer refuses it in its forward, which the overlapped schedules run in parts and so never reach.",
        "set sequence_parallel=True (or tensor_model_parallel_size=1).",
    ),
)


def _or_ungraph(first_choice: str):
    """A fix: ``first_choice``, or take attention and the router out of the graphs, in the field the user set."""
    return lambda f: f"{first_choice}, or drop 'attn'/'moe_router' from {field_set(f, GRAPH_MODULES)}."


DELAY_WGRAD_RULES: tuple[Rule, ...] = (
    Rule(
        "delay_wgrad_needs_overlap",
        (DELAY_WGRAD, OVERLAP),
        delay_wgrad_on,
        lambda f: f[OVERLAP],
        "overlap_moe_expert_parallel_comm is required for delay_wgrad_compute: the EP overlap layer step schedules "
        "the delayed wgrad.",
        "set comm_overlap.overlap_moe_expert_parallel_comm=True, or delay_wgrad_compute=False.",
    ),
    Rule(
        "delay_wgrad_grad_reduce_te",
        (OVERLAP_GRAD_REDUCE, TE),
        lambda f: delay_wgrad_with_te(f) and f[OVERLAP_GRAD_REDUCE],
        lambda f: f[TE_AT_LEAST]("2.7.0"),
        "TE version >= 2.7.0 is required for overlap_grad_reduce when using delay_wgrad_compute" + NO_TE_NOTE,
        "upgrade transformer-engine to >= 2.7.0, or set overlap_grad_reduce=False.",
    ),
    Rule(
        "delay_wgrad_grad_fusion_te",
        ("model.gradient_accumulation_fusion", TE),
        lambda f: delay_wgrad_with_te(f) and f["model.gradient_accumulation_fusion"],
        lambda f: f[TE_AT_LEAST]("2.7.0"),
        "TE version >= 2.7.0 is required for gradient_accumulation_fusion when using delay_wgrad_compute" + NO_TE_NOTE,
        "upgrade transformer-engine to >= 2.7.0, or set gradient_accumulation_fusion=False.",
    ),
    Rule(
        "delay_wgrad_repeated_mtp_unfused",
        ("model.mtp_use_repeated_layer", "model.mtp_num_layers", "model.gradient_accumulation_fusion"),
        lambda f: delay_wgrad_on(f) and f["model.mtp_use_repeated_layer"] and (f["model.mtp_num_layers"] or 0) > 1,
        lambda f: bool(f["model.gradient_accumulation_fusion"]),
        "a repeated MTP layer's delayed weight gradients reach main_grad one use at a time, where the plain path's "
        "autograd sums its uses first; without gradient_accumulation_fusion (which accumulates each use into "
        "main_grad on both paths) the two round differently.",
        "set gradient_accumulation_fusion=True, or delay_wgrad_compute=False, or mtp_use_repeated_layer=False.",
    ),
    Rule(
        "delay_wgrad_graph_te",
        (GRAPH_MODULES, TE),
        lambda f: graph_scope_needs_te_wgrad(f) and f[TE] is not None,
        lambda f: f[TE_AT_LEAST]("2.12.0"),
        "CUDA graph with delay_wgrad_compute requires TE version >= 2.12.0 (graphed attention, or a graphed router "
        "with non-overlapped shared experts)" + NO_TE_NOTE,
        _or_ungraph("upgrade transformer-engine to >= 2.12.0"),
    ),
    Rule(
        "delay_wgrad_graph_grad_fusion",
        (GRAPH_MODULES, "model.gradient_accumulation_fusion"),
        graph_scope_needs_te_wgrad,
        lambda f: bool(f["model.gradient_accumulation_fusion"]),
        "CUDA graph with delay_wgrad_compute requires gradient_accumulation_fusion: graphed wgrad needs the static "
        "main_grad buffers.",
        _or_ungraph("set gradient_accumulation_fusion=True"),
    ),
    Rule(
        "delay_wgrad_graph_attn_bias",
        (GRAPH_MODULES, "model.add_bias_linear", "model.add_qkv_bias"),
        graph_scope_needs_te_wgrad,
        lambda f: not (f["model.add_bias_linear"] or f["model.add_qkv_bias"]),
        "CUDA graph with delay_wgrad_compute does not support attention bias.",
        _or_ungraph("set add_bias_linear=False and add_qkv_bias=False"),
    ),
)
