"""CUDA graphs with the overlap: both schedules replay Transformer Engine's per-layer graphs of the parts before the
dispatch; no graph may hold the all-to-all the schedule splits, nor a whole step that waits on the host."""

from megatron.bridge.training.moe_overlap_rules.facts import (
    CHUNKS,
    GRAPH_IMPL,
    GRAPH_MODULES,
    OVERLAP,
    Rule,
    bridge_schedule,
    chunked,
    field_set,
    full_recompute,
    graphs_off,
    host_read_in_dispatch,
    te_graphs,
    whole_step_graphs,
)

_STATIC_BACKENDS = (
    "moe_token_dispatcher_type='flex' with moe_flex_dispatcher_backend='hybridep' and moe_expert_rank_capacity_factor "
    "set, or 'ncclep' with moe_ncclep_static_shape=True"
)
_BEFORE_DISPATCH = "['attn', 'moe_router', 'moe_preprocess']"


def _layer_graphs_instead(f) -> str:
    layer = f"cuda_graph_impl='transformer_engine' with {field_set(f, GRAPH_MODULES)}={_BEFORE_DISPATCH}"
    if field_set(f, GRAPH_IMPL) == "cuda_graph_impl":
        return f"set {layer} (replayed layer by layer), or {graphs_off(f)}."
    # Megatron-Core refuses the deprecated flag beside cuda_graph_impl: it goes first either way.
    return f"set {graphs_off(f)}, and {layer} for graphs replayed layer by layer."


CUDA_GRAPH_RULES: tuple[Rule, ...] = (
    Rule(
        "cuda_graph_scope",
        (GRAPH_IMPL, GRAPH_MODULES),
        lambda f: f[OVERLAP] and te_graphs(f),
        lambda f: not {"moe", "mlp"} & set(f[GRAPH_MODULES]),
        "Transformer Engine CUDA graphs over 'moe' or 'mlp' would capture the all-to-all the schedule splits.",
        lambda f: (
            f"drop 'moe' and 'mlp' from {field_set(f, GRAPH_MODULES)} (e.g. keep 'attn', 'moe_router', "
            "'moe_preprocess')."
        ),
    ),
    Rule(
        "cuda_graph_whole_layer",
        (GRAPH_IMPL, GRAPH_MODULES),
        lambda f: f[OVERLAP] and te_graphs(f),
        lambda f: bool(set(f[GRAPH_MODULES]) - {"full"}),
        lambda f: (
            f"Transformer Engine CUDA graphs with no {field_set(f, GRAPH_MODULES)} capture whole layers, the MoE "
            "layer's all-to-all included (Megatron-Core asserts EP overlap must be disabled when CUDA graph captures "
            "the whole MLP/MoE part)."
        ),
        lambda f: f"set {field_set(f, GRAPH_MODULES)}={_BEFORE_DISPATCH}.",
    ),
    Rule(
        "cuda_graph_host_sync",
        (GRAPH_IMPL, GRAPH_MODULES, "model.moe_token_dispatcher_type", "model.moe_flex_dispatcher_backend"),
        lambda f: bridge_schedule(f) and whole_step_graphs(f),
        lambda f: host_read_in_dispatch(f) is None,
        lambda f: (
            "a graph of the whole step replays device work only, so nothing in the step may wait for the host, and "
            f"{host_read_in_dispatch(f)}."
        ),
        lambda f: (
            f"{_layer_graphs_instead(f)[:-1]}; or keep the step's graph with a static-shape flex backend "
            f"({_STATIC_BACKENDS})."
        ),
    ),
    Rule(
        "cuda_graph_full_recompute",
        (GRAPH_IMPL, "model.recompute_granularity"),
        lambda f: full_recompute(f) and te_graphs(f),
        lambda f: False,
        "the replay of full recompute would run a microbatch's graph a second time inside its own backward, over "
        "the static buffers its first replay's backward still reads.",
        lambda f: f"set {graphs_off(f)}, or recompute_granularity='selective'.",
    ),
    Rule(
        "cuda_graph_chunks",
        (GRAPH_IMPL, CHUNKS),
        lambda f: chunked(f) and te_graphs(f),
        lambda f: False,
        "graphs are captured for whole microbatches, and chunking runs halves of them.",
        lambda f: f"set moe_ep_overlap_chunks=1, or {graphs_off(f)}.",
    ),
)
