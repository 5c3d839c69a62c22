"""CUDA graphs with the overlap: which implementations and scopes the schedules can replay.

Transformer Engine's per-layer graphs (``cuda_graph_impl="transformer_engine"``) over the layer's parts before the
dispatch (``attn``, ``moe_router``, ``moe_preprocess``; ``mamba`` layers whole) are replayed by both schedules. A
graph over a whole MoE layer, or over a whole step (``local``, ``full_iteration``), would have to contain the
all-to-all and what orders it.
"""

from megatron.bridge.training.moe_overlap_rules.facts import (
    CHUNKS,
    OVERLAP,
    Rule,
    bridge_schedule,
    chunked,
    full_recompute,
    te_graphs,
)

_WHOLE_STEP = ("local", "full_iteration")

CUDA_GRAPH_RULES: tuple[Rule, ...] = (
    Rule(
        "cuda_graph_scope",
        ("model.cuda_graph_impl", "model.cuda_graph_scope"),
        lambda f: f[OVERLAP] and te_graphs(f),
        lambda f: not {"moe", "mlp"} & set(f["model.cuda_graph_scope"]),
        "Transformer Engine CUDA graphs over 'moe' or 'mlp' would capture the all-to-all the schedule splits.",
        "drop 'moe' and 'mlp' from cuda_graph_scope (e.g. keep 'attn', 'moe_router', 'moe_preprocess').",
    ),
    Rule(
        "cuda_graph_whole_layer",
        ("model.cuda_graph_impl", "model.cuda_graph_scope"),
        lambda f: f[OVERLAP] and te_graphs(f),
        lambda f: bool(set(f["model.cuda_graph_scope"]) - {"full"}),
        "Transformer Engine CUDA graphs with no cuda_graph_modules capture whole layers, the MoE layer's all-to-all "
        "included (Megatron-Core asserts EP overlap must be disabled when CUDA graph captures the whole MLP/MoE "
        "part).",
        "set cuda_graph_modules=['attn', 'moe_router', 'moe_preprocess'].",
    ),
    Rule(
        "cuda_graph_host_sync",
        ("model.cuda_graph_impl", "model.cuda_graph_scope"),
        lambda f: bridge_schedule(f) and f["model.cuda_graph_impl"] in _WHOLE_STEP,
        lambda f: False,
        "a graph of the whole step cannot contain this project's schedule: every layer step synchronizes with the "
        "host (the alltoall dispatcher copies its split sizes to the host before each all-to-all, and the hook "
        "agrees each of Megatron-Core's driver calls across the expert-parallel ranks on the host), so no dispatcher "
        "qualifies yet.",
        "set cuda_graph_impl='transformer_engine' with cuda_graph_modules=['attn', 'moe_router', 'moe_preprocess'] "
        "(replayed layer by layer), or cuda_graph_impl='none'.",
    ),
    Rule(
        "cuda_graph_mtp",
        ("model.cuda_graph_impl", "model.mtp_num_layers"),
        lambda f: bridge_schedule(f) and te_graphs(f),
        lambda f: not f["model.mtp_num_layers"],
        "this project's plan runs the multi-token prediction layer whole in its head, and a graphed layer's call "
        "with overlap_moe_expert_parallel_comm on stops at its dispatch.",
        "set mtp_num_layers=None, or cuda_graph_impl='none'.",
    ),
    Rule(
        "cuda_graph_full_recompute",
        ("model.cuda_graph_impl", "model.recompute_granularity"),
        lambda f: full_recompute(f) and te_graphs(f),
        lambda f: False,
        "the replay of full recompute would run a microbatch's graph a second time inside its own backward, over "
        "the static buffers its first replay's backward still reads.",
        "set cuda_graph_impl='none', or recompute_granularity='selective'.",
    ),
    Rule(
        "cuda_graph_chunks",
        ("model.cuda_graph_impl", CHUNKS),
        lambda f: chunked(f) and te_graphs(f),
        lambda f: False,
        "graphs are captured for whole microbatches, and chunking runs halves of them.",
        "set moe_ep_overlap_chunks=1, or cuda_graph_impl='none'.",
    ),
)
