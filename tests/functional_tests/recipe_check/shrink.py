"""Test-only: a recipe's model provider at CPU size, with its structure kept (the recipe check's shrink).

Every parallel size above 1 becomes 2 (virtual stages too), the data-parallel size the smallest that the expert grid
allows (at most 8 ranks). Layers: 2 per pipeline chunk, a leading dense layer kept where the recipe has leading dense
layers; a hybrid stack's pattern: its shortest start with every kind of layer it has. A pipeline layout
(``pipeline_model_parallel_layout``) keeps its stage kinds with fewer decoders: an embedding-only first stage stays
one, the MTP layer stays beside the loss (or apart from it), and each stage keeps at most one decoder; uneven first
and last stages (``num_layers_in_first/last_pipeline_stage``) stay uneven the same way round. Widths small, the GQA
ratio kept; MLA (with or without a query LoRA rank), shared experts, MTP, biases, windows and the router's groups
kept in small sizes. Whatever a shrink cannot keep is named in the returned ``substituted`` words, never dropped
silently.
"""

import math

from tests.functional_tests.stock_bridge_loop import SEQ, VOCAB

_SIZES = {"tensor": "tensor_model_parallel_size", "pipeline": "pipeline_model_parallel_size",
          "context": "context_parallel_size", "expert": "expert_model_parallel_size",
          "expert_tensor": "expert_tensor_parallel_size"}  # fmt: skip
_KIND = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}
_LETTER = {kind: letter for letter, kind in _KIND.items()}


def stages_of(layout) -> list[list[str]]:
    """A ``pipeline_model_parallel_layout`` (its string form or lists) as lists of kind names, virtual-stage-major."""
    if isinstance(layout, str):
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

        return [[kind.name for kind in stage] for stage in PipelineParallelLayerLayout.parse_str_to_list(layout)]
    return [[getattr(kind, "name", kind).strip().lower() for kind in stage] for stage in layout]


def layout_text(stages: list[list[str]]) -> str:
    """Stages in the layout string's letters, e.g. ``Et|t|t|tmL``."""
    return "|".join("".join(_LETTER[kind] for kind in stage) for stage in stages)


def shrunk_layout(stages: list[list[str]], count: int) -> list[list[str]]:
    """``stages`` as ``count`` stages: the first and the last keep their kinds with at most one decoder, the others
    one decoder each (none where the recipe's middle stages hold none); what else the middle stages hold (a
    standalone MTP layer) goes to the last middle stage."""

    def cut(stage: list[str], decoders: int) -> list[str]:
        kept = [kind for kind in stage if kind != "decoder"]
        at = 1 if kept[:1] == ["embedding"] else 0
        return kept[:at] + ["decoder"] * decoders + kept[at:]

    first, last, middle = stages[0], stages[-1], stages[1:-1]
    middle_decoders = 1 if any("decoder" in stage for stage in middle) or not middle else 0
    middle_other = [kind for stage in middle for kind in stage if kind != "decoder"]
    new_middle = [["decoder"] * middle_decoders for _ in range(count - 2)]
    if new_middle:
        new_middle[-1] += middle_other
    elif middle_other:
        last = middle_other + last
    return [cut(first, min(first.count("decoder"), 1)), *new_middle, cut(last, min(last.count("decoder"), 1))]


def _uneven(first: int | None, last: int | None) -> tuple[int | None, int | None]:
    """Uneven first and last pipeline stages, small, the same way round."""
    if first is None and last is None:
        return None, None
    first, last = first or 0, last or 0
    return (1, 2) if first < last else (2, 1) if first > last else (1, 1)


def _dense_lead(model) -> int:
    freq = model.moe_layer_freq
    return 1 if isinstance(freq, list | tuple) and freq and freq[0] == 0 else 0


def _moe_pattern(model, count: int):
    """``moe_layer_freq`` for ``count`` layers: a leading dense layer where the recipe has any."""
    freq = model.moe_layer_freq
    if isinstance(freq, list | tuple):
        lead = _dense_lead(model)
        return [0] * lead + [1] * (count - lead)
    return freq if isinstance(freq, int) and freq <= count else 1


def _pipeline(model, sizes: dict, vpp: int | None, said: list[str]) -> int:
    """The pipeline layout's fields at the shrunk size; returns the decoder layer count."""
    stages = sizes["pipeline"] * (vpp or 1)
    layout = model.pipeline_model_parallel_layout
    first, last = model.num_layers_in_first_pipeline_stage, model.num_layers_in_last_pipeline_stage
    if layout is not None:
        if not isinstance(layout, str | list):  # already parsed by a finalized config
            layout = layout.input_data
        shrunk = shrunk_layout(stages_of(layout), stages)
        model.pipeline_model_parallel_layout = shrunk
        return sum(stage.count("decoder") for stage in shrunk)
    if first is not None or last is not None:
        if vpp:  # Megatron-Core splits uneven stages' layers over virtual chunks; not shrunk faithfully here
            said.append(f"uneven first/last stages ({first}/{last}) -> even (with virtual stages)")
            model.num_layers_in_first_pipeline_stage = model.num_layers_in_last_pipeline_stage = None
        else:
            new_first, new_last = _uneven(first, last)
            model.num_layers_in_first_pipeline_stage = new_first if first is not None else None
            model.num_layers_in_last_pipeline_stage = new_last if last is not None else None
            middle = 2 * (sizes["pipeline"] - (first is not None) - (last is not None))
            return (new_first if first is not None else 0) + (new_last if last is not None else 0) + middle
    # Where the split counts the embedding and the loss as layers, they take a decoder layer's place each: two
    # places a stage, one of them the embedding's or the loss's at either end; a lone stage keeps two decoder layers
    counted = bool(getattr(model, "account_for_embedding_in_pipeline_split", False))
    counted += bool(getattr(model, "account_for_loss_in_pipeline_split", False))
    return 2 * stages - counted if stages > 1 else 2


def _hybrid(model, pattern: str, stages: int, said: list[str]) -> None:
    """A hybrid stack: the shortest start of its pattern with every kind of layer; with pipeline stages, cut into
    that many segments (``|``); its MTP pattern (after ``/``) kept."""
    main, slash, mtp = pattern.partition("/")
    kinds = set(main.replace("|", ""))
    flat = main.replace("|", "")
    start = next(n for n in range(1, len(flat) + 1) if set(flat[:n]) == kinds)
    short = flat[: max(start, stages)]
    if stages > 1:
        cuts = [round(i * len(short) / stages) for i in range(stages + 1)]
        short = "|".join(short[a:b] for a, b in zip(cuts, cuts[1:]))
        first, last = model.num_layers_in_first_pipeline_stage, model.num_layers_in_last_pipeline_stage
        if first is not None or last is not None:  # Megatron-Core refuses them beside a pattern's '|' segments
            said.append(f"uneven first/last stages ({first}/{last}) -> the pattern's even '|' segments")
            model.num_layers_in_first_pipeline_stage = model.num_layers_in_last_pipeline_stage = None
    model.hybrid_layer_pattern = short + slash + mtp
    model.num_layers = len(short.replace("|", ""))


def _sparse_attention(model) -> None:
    """DeepSeek sparse attention's indexer small: 2 heads of 8, picking half the keys."""
    if getattr(model, "experimental_attention_variant", None) == "dsa":
        model.dsa_indexer_n_heads, model.dsa_indexer_head_dim = 2, 8
        model.dsa_indexer_topk = min(model.dsa_indexer_topk or SEQ // 2, SEQ // 2)
    if getattr(model, "moe_latent_size", None):
        model.moe_latent_size = 16


def _mixers(model, sizes: dict) -> None:
    """Mamba and gated delta net mixers small: head counts multiples of the tensor x context-parallel size; a GDN
    model keeps both its kinds of attention layer."""
    split = sizes["tensor"] * sizes["context"]
    pattern = (getattr(model, "hybrid_layer_pattern", None) or "").split("/")[0]
    if "M" in pattern:
        model.mamba_num_heads, model.mamba_head_dim, model.mamba_state_dim, model.mamba_num_groups = None, 8, 8, split
    if "G" in pattern or getattr(model, "experimental_attention_variant", None) == "gated_delta_net":
        model.linear_key_head_dim = model.linear_value_head_dim = 8
        model.linear_num_key_heads, model.linear_num_value_heads = split, 2 * split
        model.linear_conv_kernel_dim = min(model.linear_conv_kernel_dim or 4, 4)
        freq = model.linear_attention_freq
        if isinstance(freq, int):  # every freq-th layer is full attention: keep one of each kind
            model.linear_attention_freq = min(freq, 2)
        elif isinstance(freq, list | tuple):
            model.linear_attention_freq = ([1, 0] * model.num_layers)[: model.num_layers]


def _per_layer_lists(model, recipe_layers: int) -> None:
    """A field that holds one value per layer (``no_rope``, ...) for the shrunk layer count: its values in order from
    the first, repeated, over a start long enough to hold each value it has."""
    import dataclasses

    handled = {"moe_layer_freq", "linear_attention_freq", "pipeline_model_parallel_layout"}
    for field in dataclasses.fields(model):
        value = getattr(model, field.name, None)
        if field.name in handled or not isinstance(value, list | tuple) or len(value) != recipe_layers:
            continue
        distinct = {repr(v) for v in value}
        start = next(n for n in range(1, len(value) + 1) if {repr(v) for v in value[:n]} == distinct)
        cycled = (list(value[:start]) * model.num_layers)[: max(model.num_layers, 1)]
        setattr(model, field.name, type(value)(cycled))


def shrink(model) -> dict:
    """``model`` (the recipe's provider) at CPU size, in place; returns the shape it will run: ranks, data-parallel
    size, the sizes above 1, layers, the MoE pattern, the layout, and what could not be kept (``substituted``)."""
    sizes, said = {}, []
    recipe_layers = model.num_layers
    for field, name in _SIZES.items():
        sizes[field] = min(getattr(model, name) or 1, 2)
        setattr(model, name, sizes[field])
    vpp = 2 if model.virtual_pipeline_model_parallel_size else None
    model.virtual_pipeline_model_parallel_size = vpp
    grid = sizes["expert"] * sizes["expert_tensor"]
    data = grid // math.gcd(sizes["tensor"] * sizes["context"], grid)
    world = sizes["tensor"] * sizes["context"] * sizes["pipeline"] * data
    model.num_layers = _pipeline(model, sizes, vpp, said)
    model.moe_layer_freq = _moe_pattern(model, model.num_layers)
    pattern = getattr(model, "hybrid_layer_pattern", None)
    if pattern:
        _hybrid(model, pattern, sizes["pipeline"] * (vpp or 1), said)
    ratio = model.num_attention_heads // (model.num_query_groups or model.num_attention_heads)
    model.num_query_groups = sizes["tensor"]
    model.num_attention_heads = sizes["tensor"] * ratio
    model.hidden_size, model.kv_channels, model.ffn_hidden_size, model.moe_ffn_hidden_size = 32, 8, 48, 16
    if model.moe_shared_expert_intermediate_size:
        model.moe_shared_expert_intermediate_size = 16
    model.num_moe_experts = 2 * sizes["expert"]
    model.moe_router_topk = min(model.moe_router_topk or 2, 2)
    if getattr(model, "moe_router_num_groups", None):
        model.moe_router_num_groups, model.moe_router_group_topk = 2, 1
    if getattr(model, "multi_latent_attention", False):
        for name, value in dict(q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8,
                                v_head_dim=8).items():  # fmt: skip
            if name != "q_lora_rank" or getattr(model, name) is not None:  # no query LoRA stays none
                setattr(model, name, value)
    _mixers(model, sizes)
    _sparse_attention(model)
    _per_layer_lists(model, recipe_layers)
    window = getattr(model, "window_size", None)
    if isinstance(window, int):
        model.window_size = min(window, 3)
    elif window:
        model.window_size = (min(window[0], 3), window[1])
    model.seq_length, model.vocab_size, model.make_vocab_size_divisible_by = SEQ, VOCAB, VOCAB
    shape = {k: v for k, v in sizes.items() if v > 1} | ({"virtual": vpp} if vpp else {})
    return {"world": world, "data": data, "sizes": shape, "layers": model.num_layers, "freq": model.moe_layer_freq,
            "substituted": said}  # fmt: skip
