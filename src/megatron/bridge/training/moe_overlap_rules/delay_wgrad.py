"""delay_wgrad_compute: what the delayed weight gradients need."""

from megatron.bridge.training.moe_overlap_rules.facts import (
    DELAY_WGRAD,
    GRAPH_MODULES,
    GROUPED_GEMM,
    NO_TE_NOTE,
    OVERLAP,
    OVERLAP_GRAD_REDUCE,
    TE,
    TE_AT_LEAST,
    TE_GROUPED_GEMM,
    Rule,
    delay_wgrad_on,
    delay_wgrad_with_te,
    field_set,
    graph_scope_needs_te_wgrad,
)


def _or_ungraph(first_choice: str):
    """A fix: ``first_choice``, or take attention and the router out of the graphs, in the field the user set."""
    return lambda f: f"{first_choice}, or drop 'attn'/'moe_router' from {field_set(f, GRAPH_MODULES)}."


DELAY_WGRAD_RULES: tuple[Rule, ...] = (
    # --- delay_wgrad_compute ---
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
        "delay_wgrad_graph_te",
        (GRAPH_MODULES, TE),
        lambda f: graph_scope_needs_te_wgrad(f) and f[GROUPED_GEMM] == TE_GROUPED_GEMM,
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
