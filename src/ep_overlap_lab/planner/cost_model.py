"""Planner costs from a model shape, a parallel layout and a hardware profile, for clusters not at hand.

Contract:
    * :func:`costs_from_model` turns FLOPs and bytes into the planner's per-layer :class:`StepCosts` and a
      :class:`Link` for one rank: compute time = FLOPs / (peak x efficiency); an all-to-all is booked as the rank's
      tokens x top-k x hidden x 2 bytes (bf16) that leave it ((EP-1)/EP of them), and the link's rate is what the
      dispatcher backend achieves for them (``planner/dispatchers.py``: its NVLink and network traffic, and the
      contention between the all-to-all and the compute beside it).
    * Every number of a profile is stated with where it comes from (``planner/hardware.py``): datasheet figures are
      marked as such; efficiencies and latency are this project's assumptions, chosen before comparing with any
      published step time and not tuned to one.
    * Left out (the same in both arms, so they shift step time, not what overlap hides): data-parallel gradient
      sync, the optimizer, memory limits. (:func:`activation_shape` gives ``planner/memory.py`` a published shape,
      for the activations each option holds.) Pipeline parallelism is not modelled (PP = 1): the figures are those of
      a rank holding all layers, i.e. of its layer steps.
"""

from dataclasses import dataclass, replace

from ep_overlap_lab.planner.dispatchers import ALLTOALL, BYTES_PER_ELEMENT, Dispatcher, link_for
from ep_overlap_lab.planner.hardware import PROFILES, HardwareProfile
from ep_overlap_lab.planner.memory import ActivationShape
from ep_overlap_lab.planner.simulate import LayerCosts, Link, StepCosts

__all__ = ["BYTES_PER_ELEMENT", "PROFILES", "Dispatcher", "HardwareProfile", "Layout", "MoEShape", "costs_from_model"]


@dataclass(frozen=True)
class MoEShape:
    """A decoder-only MoE transformer. ``mla`` = (q_lora_rank, kv_lora_rank, qk_nope_dim, qk_rope_dim, v_dim)
    for multi-head latent attention; else grouped-query attention with ``num_query_groups``."""

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    head_dim: int
    num_experts: int
    topk: int
    moe_ffn: int
    vocab: int
    seq_length: int
    num_query_groups: int | None = None
    dense_layers: int = 0  # the first layers are dense (DeepSeek-V3: 3)
    dense_ffn: int = 0
    shared_expert_ffn: int = 0
    mla: tuple[int, int, int, int, int] | None = None
    router: str = "softmax"  # how experts are scored (planner/memory.py): softmax, softmax_pre or sigmoid


@dataclass(frozen=True)
class Layout:
    """How the model is spread: data/expert parallel over ``gpus`` (TP = PP = 1), ``global_batch`` sequences."""

    gpus: int
    ep: int
    global_batch: int
    micro_batch: int = 1

    @property
    def num_microbatches(self) -> int:
        return max(1, self.global_batch // (self.gpus * self.micro_batch))


def _attention_flops(s: MoEShape, tokens: int) -> float:
    """Forward FLOPs of attention for ``tokens`` tokens of sequences of ``s.seq_length`` (causal)."""
    h, heads = s.hidden, s.num_heads
    if s.mla:
        q_lora, kv_lora, nope, rope, v = s.mla
        # without a query down-projection (q_lora_rank None, given as 0) the queries come from the hidden state
        queries = h * q_lora + q_lora * heads * (nope + rope) if q_lora else h * heads * (nope + rope)
        projections = queries + h * (kv_lora + rope)
        projections += kv_lora * heads * (nope + v) + heads * v * h
        core = s.seq_length * heads * (nope + rope + v)  # QK^T and PV, halved for causal masking
    else:
        groups = s.num_query_groups or heads
        projections = h * (heads + 2 * groups) * s.head_dim + heads * s.head_dim * h
        core = s.seq_length * heads * 2 * s.head_dim
    return 2 * tokens * projections + tokens * core


def costs_from_model(
    shape: MoEShape,
    layout: Layout,
    profile: HardwareProfile,
    recompute: frozenset[str] = frozenset(),
    segments: tuple[tuple[int, int], ...] = (),
    dispatcher: Dispatcher = ALLTOALL,
) -> tuple[StepCosts, Link]:
    """Per-rank costs of one microbatch of ``layout.micro_batch`` sequences, and the rank's link for ``dispatcher``
    (``planner/dispatchers.py``: its traffic, and the contention between it and the compute).

    ``segments`` (full recompute, ``segment_of``): the simulator charges each replayed layer its forward again.

    ``recompute`` (``recompute_modules``) charges each recomputed forward to the backward node that runs it: ``moe``
    the experts' GEMMs to the experts' backward, ``mlp`` a dense layer's MLP and ``core_attn`` the attention core to
    the attention's backward; ``layernorm`` and ``moe_act`` are elementwise and cost no FLOPs here."""
    tokens = layout.micro_batch * shape.seq_length
    rate = profile.peak_flops * profile.compute_efficiency
    attention = _attention_flops(shape, tokens)
    core = attention - _attention_flops(replace(shape, seq_length=0), tokens)  # QK^T and PV, without projections
    again = core if "core_attn" in recompute else 0.0
    router = 2 * tokens * shape.hidden * shape.num_experts
    shared = 2 * tokens * shape.hidden * shape.shared_expert_ffn * 3
    experts = 2 * tokens * shape.topk * shape.hidden * shape.moe_ffn * 3  # SwiGLU: gate, up and down projections
    a2a_bytes = tokens * shape.topk * shape.hidden * BYTES_PER_ELEMENT * (layout.ep - 1) / layout.ep
    layers = []
    for index in range(shape.num_layers):
        if index < shape.dense_layers:
            mlp = 2 * tokens * shape.hidden * shape.dense_ffn * 3
            b_pre = 2 * (attention + mlp) + again + (mlp if "mlp" in recompute else 0.0)
            layers.append(LayerCosts(f_pre=(attention + mlp) / rate, f_exp=0.0, b_exp=0.0, b_pre=b_pre / rate))
        else:
            pre = (attention + router + shared) / rate
            layers.append(
                LayerCosts(
                    f_pre=pre,
                    f_exp=experts / rate,
                    b_exp=(3 if "moe" in recompute else 2) * experts / rate,
                    b_pre=2 * pre + again / rate,
                    dispatch_bytes=a2a_bytes,
                    combine_bytes=a2a_bytes,
                )
            )
    head = 2 * tokens * shape.hidden * shape.vocab / rate
    costs = StepCosts(layers=tuple(layers), f_tail=head, b_head=2 * head, segments=tuple(segments))
    link = link_for(
        dispatcher, profile, experts=shape.num_experts, topk=shape.topk, ep=layout.ep, tokens=tokens,
        hidden=shape.hidden, booked_bytes=a2a_bytes,
    )  # fmt: skip
    return costs, link


def activation_shape(shape: MoEShape, layout: Layout, recompute: frozenset[str] = frozenset()) -> ActivationShape:
    """The memory accounting's view of a published shape, bf16, SwiGLU, balanced routing (an estimate: see
    planner/memory.py), with ``recompute`` (``recompute_modules``). Latent attention keeps its per-head queries,
    keys and values, and its down-projections' outputs and their norms."""
    if shape.mla:
        q_lora, kv_lora, nope, rope, v = shape.mla
        qkv, out = shape.num_heads * (2 * (nope + rope) + v), shape.num_heads * v
        extra = 2 * q_lora + 2 * kv_lora + rope
    else:
        groups = shape.num_query_groups or shape.num_heads
        qkv, out, extra = (shape.num_heads + 2 * groups) * shape.head_dim, shape.num_heads * shape.head_dim, 0
    return ActivationShape(
        moe=tuple(index >= shape.dense_layers for index in range(shape.num_layers)),
        hidden=shape.hidden,
        heads=shape.num_heads,
        seq_length=shape.seq_length,
        sequences=layout.micro_batch,
        vocab=shape.vocab,
        dense_ffn=shape.dense_ffn,
        moe_ffn=shape.moe_ffn,
        experts=shape.num_experts,
        topk=shape.topk,
        element_bytes=BYTES_PER_ELEMENT,
        gated=True,
        router=shape.router,
        qkv_width=qkv,
        attention_out_width=out,
        extra_attention_width=extra,
        shared_ffn=shape.shared_expert_ffn,
        recompute=recompute,
    )


# Published shapes (model cards / configs); sequence length 4096 for all.
QWEN3_30B_A3B = MoEShape(
    "Qwen3-30B-A3B", num_layers=48, hidden=2048, num_heads=32, head_dim=128, num_query_groups=4, num_experts=128,
    topk=8, moe_ffn=768, vocab=151936, seq_length=4096, router="softmax_pre",
)  # fmt: skip
DEEPSEEK_V3 = MoEShape(
    "DeepSeek-V3-like", num_layers=61, hidden=7168, num_heads=128, head_dim=128, num_experts=256, topk=8,
    moe_ffn=2048, vocab=129280, seq_length=4096, dense_layers=3, dense_ffn=18432, shared_expert_ffn=2048,
    mla=(1536, 512, 128, 64, 128), router="sigmoid",
)  # fmt: skip
MIXTRAL_8X7B = MoEShape(
    "Mixtral-8x7B-like", num_layers=32, hidden=4096, num_heads=32, head_dim=128, num_query_groups=8, num_experts=8,
    topk=2, moe_ffn=14336, vocab=32000, seq_length=4096,
)  # fmt: skip
SHAPES = {"qwen3-30b-a3b": QWEN3_30B_A3B, "deepseek-v3": DEEPSEEK_V3, "mixtral-8x7b": MIXTRAL_8X7B}
