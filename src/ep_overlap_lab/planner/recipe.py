"""A built recipe's fields, priced as the recipe is: its model, layout, batch, dispatcher and recompute, on the
hardware its name says (pure Python; no torch: the fields come as plain values, built by
``scripts/performance/utils/plan_recipe.py``).

Contract:
    * :func:`price_recipe` takes the fields ``plan_recipe_worker.fields_of`` writes and the recipe's name, and returns
      a :class:`RecipePrice`: the plain step, the overlapped step with the recipe's own delayed-wgrad setting (the
      figure a user of the recipe gets), and the other setting, at the recipe's microbatch count. It raises
      :class:`RecipeRefusal` (one line: the field, its value, why) for what the planner cannot price.
    * The hardware is the name's (``h100``, ``h200``, ``b200``, ``b300``, ``gb200``, ``gb300``) unless a profile is
      given; the GPU count the name's (``16gpu``), else the fewest the layout needs.
    * Approximations, said in :attr:`RecipePrice.notes` where they apply: tensor and context parallelism split each
      microbatch's tokens over their ranks (their own communication is not priced, the same in both arms); a
      pipeline is priced as its busiest rank (the layers of its chunks, per the recipe's layout, and the head if it
      holds it) plus the 1F1B bubble, ``(PP - 1) / VPP``
      microbatches of that stage, in both arms; FP8/FP4 recipes at BF16 rates; MTP layers not priced; dense layers
      of an interleaved ``moe_layer_freq`` priced as if first.
"""

import math
import re
from dataclasses import dataclass, field, replace

from ep_overlap_lab.planner.cost_model import PROFILES, Dispatcher, Layout, MoEShape, costs_from_model
from ep_overlap_lab.planner.simulate import predict
from megatron.bridge.training.ep_overlap.options import EPOverlapOptions

HARDWARE = {"gb300": "GB300", "gb200": "GB200", "b300": "B300", "b200": "B200", "h200": "H200", "h100": "H100"}
RECOMPUTE_MODULES = {"layernorm", "core_attn", "moe_act", "mlp", "moe"}


class RecipeRefusal(ValueError):
    """What the planner cannot price in a recipe; ``str()`` is the one line to print."""


@dataclass
class RecipePrice:
    """One recipe priced: steps in seconds, plain and overlapped (with and without delayed wgrad)."""

    name: str
    profile: str
    gpus: int
    microbatches: int
    plain_s: float
    overlap_s: float  # delayed wgrad as the recipe sets it
    other_s: float  # the other delayed-wgrad setting
    delay_wgrad: bool
    recipe_overlap: bool
    dispatcher: Dispatcher
    notes: list[str] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        return self.plain_s / self.overlap_s


def _field(model: dict, name: str, default=None):
    value = model.get(name)
    return default if value is None else value


def profile_of(name: str) -> str | None:
    """The profile a recipe's name says (``..._h100_...``; an unknown GPU, ``vr200``, in capitals), or None."""
    tokens = re.split(r"[_.]", name.lower())
    known = next((HARDWARE[t] for t in tokens if t in HARDWARE), None)
    return known or next((t.upper() for t in tokens if re.fullmatch(r"g?[a-z]{1,2}\d{3}", t)), None)


def gpus_of(name: str) -> int | None:
    match = re.search(r"_(\d+)gpus?_", name.lower())
    return int(match.group(1)) if match else None


def shape_of(fields: dict) -> tuple[MoEShape, list[str]]:
    """The recipe's model as the planner's shape, and what was approximated."""
    m, notes = fields["model"], []
    if m.get("hybrid_layer_pattern"):
        raise RecipeRefusal(
            f"model.hybrid_layer_pattern={m['hybrid_layer_pattern']!r}: hybrid Mamba layers; the planner has no cost "
            "for a Mamba mixer"
        )
    layers, freq = m["num_layers"], _field(m, "moe_layer_freq", 1)
    moe = [i % freq == 0 for i in range(layers)] if isinstance(freq, int) else [bool(f) for f in freq]
    dense = layers - sum(moe)
    if dense and moe[:dense] != [False] * dense:
        notes.append(f"{dense} dense layers interleaved with MoE ones, priced as if first")
    heads, hidden = m["num_attention_heads"], m["hidden_size"]
    mla = None
    if m.get("multi_latent_attention"):
        dims = ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
        mla = (_field(m, "q_lora_rank", 0), *(m[k] for k in dims))
    if m.get("mtp_num_layers"):
        notes.append(f"{m['mtp_num_layers']} MTP layer(s) not priced")
    seq = _field(m, "seq_length", fields.get("dataset_seq_length"))
    shape = MoEShape(
        name=f"{layers} layers", num_layers=layers, hidden=hidden, num_heads=heads,
        head_dim=_field(m, "kv_channels", hidden // heads), num_experts=m["num_moe_experts"],
        topk=m["moe_router_topk"], moe_ffn=_field(m, "moe_ffn_hidden_size", m["ffn_hidden_size"]),
        vocab=_field(m, "vocab_size", 0), seq_length=seq, num_query_groups=m.get("num_query_groups"),
        dense_layers=dense, dense_ffn=_field(m, "ffn_hidden_size", 0),
        shared_expert_ffn=_field(m, "moe_shared_expert_intermediate_size", 0), mla=mla,
    )  # fmt: skip
    return shape, notes


def dispatcher_of(model: dict) -> Dispatcher:
    if model.get("moe_token_dispatcher_type") != "flex":
        return Dispatcher("alltoall")
    backend = _field(model, "moe_flex_dispatcher_backend", "deepep")
    sms = model.get("moe_flex_dispatcher_num_sms") or model.get(f"moe_{backend}_num_sms")
    static = backend == "ncclep" and bool(model.get("moe_ncclep_static_shape"))
    return Dispatcher(backend, sms, static)


def _layout(fields: dict, name: str, gpus: int | None) -> tuple[dict, list[str]]:
    m, notes = fields["model"], []
    tp, pp, cp = (_field(m, k, 1) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                             "context_parallel_size"))  # fmt: skip
    ep, etp = _field(m, "expert_model_parallel_size", 1), _field(m, "expert_tensor_parallel_size", 1)
    if etp != 1:
        raise RecipeRefusal(f"model.expert_tensor_parallel_size={etp}: the planner prices expert TP 1 only")
    if gpus is None:
        gpus = pp * math.lcm(tp * cp, ep)
        notes.append(f"{gpus} GPUs: the fewest its layout needs (its name gives none)")
    dp = gpus // (tp * pp * cp)
    gbs, mbs = fields["global_batch_size"], fields["micro_batch_size"]
    stage = gpus // pp  # the ranks of one pipeline stage: TP x CP x DP of them, EP x expert-DP for the experts
    if gpus % (tp * pp * cp) or stage % ep:
        raise RecipeRefusal(
            f"model.expert_model_parallel_size={ep}: must divide the {stage} ranks of a pipeline stage ({gpus} GPUs, "
            f"PP {pp}, TP {tp}, CP {cp}); give --gpus for the count the recipe runs on"
        )
    if gbs % (mbs * dp):
        raise RecipeRefusal(
            f"train.global_batch_size={gbs}: not whole microbatches of {mbs} on {dp} data-parallel ranks; give --gpus"
        )
    vpp = _field(m, "virtual_pipeline_model_parallel_size", 1)
    if tp * cp > 1:
        notes.append(f"TP {tp} x CP {cp} split each microbatch's tokens (their own communication not priced)")
    if pp > 1:
        notes.append(f"PP {pp}" + (f" x VPP {vpp}" if vpp > 1 else "") + ": its busiest rank plus the 1F1B bubble")
    return {"gpus": gpus, "tp": tp, "pp": pp, "vpp": vpp, "cp": cp, "ep": ep, "dp": dp, "n": gbs // (mbs * dp),
            "mbs": mbs, "gbs": gbs}, notes  # fmt: skip


def _recompute(model: dict, layers: int) -> tuple[frozenset, tuple]:
    if model.get("recompute_granularity") == "full":
        method, n = model.get("recompute_method"), _field(model, "recompute_num_layers", 1)
        if method == "uniform":  # as the engine's Settings.segments cuts them
            return frozenset(), tuple((i, min(i + n, layers)) for i in range(0, layers, n))
        return frozenset(), tuple((i, i + 1) for i in range(min(n, layers)))
    modules = frozenset(_field(model, "recompute_modules", ())) & RECOMPUTE_MODULES
    return (modules if model.get("recompute_granularity") == "selective" else frozenset()), ()


def price_recipe(fields: dict, name: str, profile: str | None = None, gpus: int | None = None) -> RecipePrice:
    """``fields`` (``plan_recipe_worker.fields_of``) priced: see the module docstring.

    Raises:
        RecipeRefusal: No hardware profile for it, no expert parallelism, a model or layout the planner cannot price.
    """
    notes = []
    profile = profile or profile_of(name)
    if profile is None:
        profile = "H100"
        notes.append("its name names no GPU: priced on H100 (--profile picks another)")
    if profile not in PROFILES:
        raise RecipeRefusal(
            f"its name says {profile}, which has no hardware profile (the planner's: {', '.join(PROFILES)}): give "
            "--profile"
        )
    m = fields["model"]
    if (m.get("num_moe_experts") or 0) < 2 or _field(m, "expert_model_parallel_size", 1) < 2:
        raise RecipeRefusal(
            f"model.num_moe_experts={m.get('num_moe_experts')}, model.expert_model_parallel_size="
            f"{m.get('expert_model_parallel_size')}: not a MoE model with expert parallelism above 1: nothing to hide"
        )
    shape, more = shape_of(fields)
    layout, most = _layout(fields, name, gpus or gpus_of(name))
    notes += more + most
    if m.get("fp8") or m.get("fp4"):
        notes.append(f"{'FP8' if m.get('fp8') else 'FP4'} recipe priced at BF16 rates")
    recompute, segments = _recompute(m, shape.num_layers)
    dispatcher = dispatcher_of(m)
    costs, link = costs_from_model(shape, Layout(layout["gpus"], layout["ep"], layout["gbs"], layout["mbs"]),
                                   PROFILES[profile], recompute, segments, dispatcher)  # fmt: skip
    costs = _stage(costs.scaled(1 / (layout["tp"] * layout["cp"])), link, m, layout["pp"], layout["vpp"])
    delay = bool(fields.get("delay_wgrad"))
    n = layout["n"]
    on, other = (predict(costs, link, n, EPOverlapOptions(delay_wgrad=d)) for d in (delay, not delay))
    bubble = 1 + (layout["pp"] - 1) / (layout["vpp"] * n)  # both arms: (PP - 1) / VPP microbatches of the stage
    return RecipePrice(
        name, profile, layout["gpus"], n, on.baseline.step_s * bubble, on.overlap.step_s * bubble,
        other.overlap.step_s * bubble, delay, bool(fields.get("overlap")), dispatcher, notes,
    )  # fmt: skip


def virtual_stages(model: dict, pp: int, vpp: int) -> list[tuple[int, bool]]:
    """Each virtual stage's (decoder layers, holds the head), virtual-stage-major: the recipe's
    ``pipeline_model_parallel_layout`` where it has one, else its first/last stage counts and the rest even."""
    if model.get("pipeline_stages"):
        return [(stage.count("decoder"), "loss" in stage) for stage in model["pipeline_stages"]]
    count, layers = pp * vpp, model["num_layers"]
    first, last = model.get("num_layers_in_first_pipeline_stage"), model.get("num_layers_in_last_pipeline_stage")
    ends = [first or 0, last or 0]
    middle = count - (first is not None) - (last is not None)
    rest = layers - sum(ends)
    even = [rest // middle + (i < rest % middle) for i in range(middle)] if middle else []
    stages = ([first] if first is not None else []) + even + ([last] if last is not None else [])
    return [(n, i == count - 1) for i, n in enumerate(stages)]


def _stage(costs, link, model: dict, pp: int, vpp: int):
    """The costs of the pipeline rank whose plain work is the largest: its chunks' layers, and the head if it holds
    it (rank r holds virtual stages r, r + PP, ...)."""
    if pp <= 1:
        return costs
    stages, start, ranks = virtual_stages(model, pp, vpp), 0, [([], False) for _ in range(pp)]
    for v, (decoders, head) in enumerate(stages):
        layers, holds = ranks[v % pp]
        ranks[v % pp] = (layers + list(range(start, start + decoders)), holds or head)
        start += decoders

    def work(rank) -> float:
        layers, head = rank
        mine = [costs.layers[i] for i in layers if i < len(costs.layers)]
        a2a = sum(2 * (layer.dispatch_bytes + layer.combine_bytes) for layer in mine) / link.bandwidth_Bps
        compute = sum(layer.f_pre + layer.f_exp + layer.b_exp + layer.b_pre for layer in mine)
        return compute + a2a + ((costs.f_tail + costs.b_head) if head else 0.0)

    layers, head = max(ranks, key=work)
    position = {layer: i for i, layer in enumerate(layers)}
    segments = tuple(
        (position[a], position[b - 1] + 1)
        for a, b in costs.segments
        if all(i in position for i in range(a, b)) and position[b - 1] - position[a] == b - 1 - a
    )
    return replace(
        costs, layers=tuple(costs.layers[i] for i in layers), segments=segments,
        f_tail=costs.f_tail if head else 0.0, b_head=costs.b_head if head else 0.0,
    )  # fmt: skip
