"""Bytes held for backward, node by node, from a model's shape, and the peak a schedule program holds.

Contract:
    * :class:`ActivationShape` is a MoE transformer as the reference MoE GPT builds it (``models/moe_gpt``):
      attention, a dense or MoE MLP per layer, a router scoring experts by ``softmax`` (top-k, then softmax),
      ``softmax_pre`` (softmax, then top-k) or ``sigmoid``. :meth:`ActivationShape.saved` lists, for one unit of
      ``sequences`` sequences, each tensor a forward node saves for backward: a name (one storage, however many ops
      save it) and its bytes. Tensors saved by two nodes of a unit carry one name in both.
    * :func:`activation_peak` (and :func:`predicted_peak`, which builds the PP = 1 program) walks one rank's
      schedule program (``program/steps.py``) and counts those storages
      as ``engine/saved.py`` counts them: from the first node that saves one until the last holder lets it go
      (its node's backward, or a delayed weight gradient that keeps its input and output gradient until its
      ``wgrad`` op). The result is the peak, in bytes, over the step.
    * Exact for the reference model on CPU: the tests compare both against ``StepResult.activation_peak_bytes`` for
      every schedule option. With ``recompute`` an upper bound: what a node's backward rebuilds is counted on top
      of all the node holds, over by at most that (autograd rebuilds one part at a time, after letting some go).
      Other shapes (the planner's published ones, with grouped-query or latent attention and shared experts) use
      the same accounting with their widths: an estimate of what Megatron-Core keeps, which also depends on its
      kernels (fused attention, Transformer Engine).

Shape suffixes as in ``models/moe_gpt``: T tokens of the unit, D hidden, P = T x top-k slots, R received rows.
"""

from dataclasses import dataclass, replace

from ep_overlap_lab.pipeline_layout import chunk_layers
from ep_overlap_lab.planner.holds import UnitHolds
from ep_overlap_lab.program.runners import NoComm
from ep_overlap_lab.program.steps import Step, program
from ep_overlap_lab.program.units import Unit
from ep_overlap_lab.storage_count import Count
from megatron.bridge.training.ep_overlap.contract import segment_of
from megatron.bridge.training.ep_overlap.program.interpreter import run_ops
from megatron.bridge.training.ep_overlap.program.steps import ChunkShape
from megatron.bridge.training.ep_overlap.settings import resolve

INDEX_BYTES = 8  # int64 routing indices, token ids and labels
FP32 = 4  # router scores and the loss's log-probabilities are kept in fp32

_LAYER_NODES = ("pre_dispatch", "experts", "combine")


@dataclass(frozen=True)
class ActivationShape:
    """What decides the bytes a unit saves. Widths are per token, in elements.

    Args:
        moe: Per layer, whether it is an MoE layer.
        hidden: Hidden size.
        heads: Attention heads (the softmax statistics kept per head and token).
        seq_length: Tokens per sequence.
        sequences: Sequences per microbatch.
        vocab: Vocabulary size.
        dense_ffn: FFN width of dense layers.
        moe_ffn: FFN width of one expert.
        experts: Number of experts.
        topk: Experts per token.
        element_bytes: Bytes of one activation element (4 fp32, 2 bf16).
        gated: SwiGLU (else GELU).
        router: "softmax", "softmax_pre" or "sigmoid".
        qkv_width: Width of the fused query/key/value projection's output (default 3 x hidden).
        attention_out_width: Width of the attention's output before its projection (default hidden).
        extra_attention_width: Widths an attention kernel keeps beyond those (latent attention's projections).
        shared_ffn: FFN width of the shared experts (0: none).
        received_rows_factor: Rows an MoE layer receives per token of the unit (top-k when routing is balanced).
        recompute: Megatron-Core's ``recompute_modules`` (selective), as the reference model recomputes them.
        rms_norm: RMSNorm instead of LayerNorm: torch's RMSNorm keeps an fp32 statistic per token and an fp32
            normalized copy (and, for a 16-bit input, the input upcast to fp32).
        load_balancing: The router's load-balancing loss, "aux_loss" or "seq_aux_loss" (None: none); it keeps the
            fp32 scores over all experts and their per-expert (per-sequence, per-expert) token counts.
        z_loss: The router's z-loss: it keeps the router logits and their log-sum-exp.
        segments: Full recompute's segments of the (one) chunk (``segment_of``): each keeps only its input until
            its replay.
    """

    moe: tuple[bool, ...]
    hidden: int
    heads: int
    seq_length: int
    sequences: int
    vocab: int
    dense_ffn: int
    moe_ffn: int
    experts: int
    topk: int
    element_bytes: int = 4
    gated: bool = False
    router: str = "softmax"
    qkv_width: int | None = None
    attention_out_width: int | None = None
    extra_attention_width: int = 0
    shared_ffn: int = 0
    received_rows_factor: float | None = None
    recompute: frozenset[str] = frozenset()
    rms_norm: bool = False
    load_balancing: str | None = None
    z_loss: bool = False
    segments: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):
        if self.router not in ("softmax", "softmax_pre", "sigmoid"):
            raise ValueError(f"router={self.router!r}: use 'softmax', 'softmax_pre' or 'sigmoid'")

    @classmethod
    def of_reference_model(cls, config, micro_batch_size: int) -> "ActivationShape":
        """The reference MoE GPT of ``config`` (a ``MoEGPTConfig``, read by field name), for microbatches of
        ``micro_batch_size`` sequences; MoE layers receive top-k rows per token (balanced routing)."""
        heads = config.num_attention_heads
        groups = config.num_query_groups or heads
        head_dim = config.kv_channels or config.hidden_size // heads
        router = "sigmoid" if config.moe_router_score_function == "sigmoid" else "softmax"
        if router == "softmax" and config.moe_router_pre_softmax:
            router = "softmax_pre"
        return cls(
            moe=tuple(config.is_moe_layer(i) for i in range(config.num_layers)),
            hidden=config.hidden_size,
            heads=config.num_attention_heads,
            seq_length=config.seq_length,
            sequences=micro_batch_size,
            vocab=config.vocab_size,
            dense_ffn=config.ffn_hidden_size,
            moe_ffn=config.moe_ffn_hidden_size or config.ffn_hidden_size,
            experts=config.num_moe_experts or 0,
            topk=config.moe_router_topk,
            element_bytes=2 if (config.bf16 or config.fp16) else 4,
            gated=config.gated_linear_unit,
            router=router,
            recompute=frozenset(config.recompute_modules or ())
            if config.recompute_granularity == "selective"
            else frozenset(),
            qkv_width=(heads + 2 * groups) * head_dim,
            attention_out_width=heads * head_dim,
            # grouped-query attention: the key and value heads repeated for the query heads, saved by the attention
            extra_attention_width=2 * heads * head_dim if groups < heads else 0,
            rms_norm=getattr(config, "normalization", "LayerNorm") == "RMSNorm",
            shared_ffn=config.moe_shared_expert_intermediate_size or 0,
            load_balancing=config.moe_router_load_balancing_type
            if config.moe_router_load_balancing_type in ("aux_loss", "seq_aux_loss") and config.moe_aux_loss_coeff
            else None,
            z_loss=config.moe_z_loss_coeff is not None,
            segments=resolve(config).segments(config.num_layers),
        )

    def received_rows(self, T: int) -> int:
        """Rows an MoE layer's experts get for ``T`` tokens of the unit."""
        return round(T * (self.received_rows_factor or self.topk))

    @property
    def qkv(self) -> int:
        return self.qkv_width or 3 * self.hidden

    def saved(self, node: str, layer: int | None, sequences: int) -> list[tuple[str, int]]:
        """(name, bytes) of what ``node`` (of ``layer``; None at the chunk's ends) saves for a unit of ``sequences``
        sequences. Names are local to the unit and layer; ``tokens`` and ``labels`` belong to the microbatch."""
        T, D, es = sequences * self.seq_length, self.hidden, self.element_bytes
        if node == "embedding":  # the token ids (the microbatch's storage, a half's rows are a view) and positions
            return [("tokens", self.sequences * self.seq_length * INDEX_BYTES), ("positions", self.seq_length * 8)]
        if node == "head":  # final norm, output layer input, log-probabilities, target ids, the loss's weight
            saved = [
                ("head_x", T * D * es), *self._norm("head_norm", T, D, es), ("head_norm", T * D * es),
                ("log_probs", T * self.vocab * FP32), ("labels", self.sequences * self.seq_length * INDEX_BYTES),
                ("total_weight", FP32),
            ]  # fmt: skip
            return [item for item in saved if item[0] != "head_x" or not (self.rms_norm and es != FP32)]
        return self._split(node, layer, sequences)[0]

    def freed_outputs(self, node: str, layer: int | None, sequences: int) -> list[tuple[str, int]]:
        """(name, bytes) of the outputs ``node`` frees in its forward once the next linear ran (``layernorm``,
        ``moe_act``): held from that linear until freed, one at a time."""
        if layer is None:
            return []
        outputs = {"ln1_out", "n"} if node == "pre_dispatch" and "layernorm" in self.recompute else set()
        if node == "experts" and "moe_act" in self.recompute and "moe" not in self.recompute:
            outputs.add("expert_act")
        return [item for item in self.rebuilt(node, layer, sequences) if item[0] in outputs]

    def rebuilt(self, node: str, layer: int | None, sequences: int) -> list[tuple[str, int]]:
        """(name, bytes) of what ``node``'s backward holds again with ``recompute``: the recomputed parts' saves and
        the outputs freed until the next linear's backward. Counted on top of all the node holds, from the start of
        its backward (autograd rebuilds them one part at a time, after some of the node's tensors are let go: the
        figure is an upper bound by at most these bytes)."""
        return [] if layer is None else self._split(node, layer, sequences)[1]

    def _split(self, node: str, layer: int, sequences: int) -> tuple[list, list]:
        """What a layer's ``node`` saves without recompute, split into what it keeps with ``recompute`` and what its
        backward rebuilds."""
        T, D, es, moe = sequences * self.seq_length, self.hidden, self.element_bytes, self.moe[layer]
        full = getattr(self, f"_{node}")(T, D, es, moe)
        if node == "experts" and moe and "moe" in self.recompute:  # the experts keep only the rows they received
            return [("received", self.received_rows(T) * D * es)], full
        dropped = self._recomputed(node, moe)
        return [item for item in full if item[0] not in dropped], [item for item in full if item[0] in dropped]

    def _recomputed(self, node: str, moe: bool) -> set[str]:
        """What ``node`` no longer holds between nodes with ``recompute``: a recomputed part's own saves, and the
        outputs ``layernorm`` and ``moe_act`` free until the next linear's backward."""
        dropped = set()
        if node == "pre_dispatch":
            if "layernorm" in self.recompute:
                norms = {f"{ln}_{part}" for ln in ("ln1", "ln2") for part in ("stats", "normed", "upcast")}
                dropped |= norms | {"ln1_out"} | ({"n"} if moe else set())
            if "core_attn" in self.recompute:
                dropped.add("lse")
        elif node == "experts":
            if moe and "moe_act" in self.recompute:
                dropped |= {"expert_silu", "expert_act"}
            if not moe and "mlp" in self.recompute:
                dropped |= {"mlp_fc1_out", "mlp_silu", "mlp_act"}
        return dropped

    def _norm_keeps_upcast_input(self, es: int) -> bool:
        """A 16-bit RMSNorm keeps its input's fp32 copy instead of the input (unless a recompute keeps the input)."""
        return self.rms_norm and es != FP32 and "layernorm" not in self.recompute

    def _norm(self, prefix: str, T: int, D: int, es: int) -> list[tuple[str, int]]:
        """What one norm keeps for backward beyond its input and output."""
        if not self.rms_norm:
            return [(f"{prefix}_stats", 2 * T * es)]
        kept = [(f"{prefix}_stats", T * FP32), (f"{prefix}_normed", T * D * FP32)]
        return kept + ([(f"{prefix}_upcast", T * D * FP32)] if es != FP32 else [])

    def _pre_dispatch(self, T: int, D: int, es: int, moe: bool) -> list[tuple[str, int]]:
        out = self.attention_out_width or D
        saved = [
            ("x", T * D * es), *self._norm("ln1", T, D, es), ("ln1_out", T * D * es), ("qkv", T * self.qkv * es),
            ("lse", T * self.heads * FP32), ("o", T * out * es), ("h", T * D * es), *self._norm("ln2", T, D, es),
        ]  # fmt: skip
        if self._norm_keeps_upcast_input(es):  # the norms keep their inputs' fp32 copies, not the inputs
            saved = [item for item in saved if item[0] not in ("x", "h")]
        if self.extra_attention_width:
            saved.append(("attention_extra", T * self.extra_attention_width * es))
        if not moe:
            return saved
        if self.shared_ffn:  # on the MLP norm's output ("n"), saved by the router too
            saved += self._mlp("shared", T, self.shared_ffn, es)
        K, E, P = self.topk, self.experts, T * self.topk
        saved += [("n", T * D * es), ("route_index", T * K * INDEX_BYTES)]
        if self.router == "softmax":
            saved.append(("probs", T * K * FP32))
        else:
            saved.append(("scores", T * E * FP32))
            if self.router == "sigmoid" and K > 1:  # normalized over the top-k: the sum and the top-k scores
                saved += [("score_sum", T * FP32), ("top_scores", T * K * FP32)]
        return (
            saved + self._router_losses(T, es, sequences=T // self.seq_length) + [("permute_index", P * INDEX_BYTES)]
        )

    def _router_losses(self, T: int, es: int, sequences: int) -> list[tuple[str, int]]:
        """What the z-loss and the load-balancing loss keep (``models/moe_gpt/router_losses.py``), with the loss
        each hands its scaler."""
        E, saved = self.experts, []
        if self.z_loss:  # the log-sum-exp keeps the logits and its result, which the square reads
            saved += [("z_logits", T * E * es), ("z_logsumexp", T * es), ("z_loss", es)]
        if self.load_balancing:
            saved.append(("aux_scores", T * E * FP32))
            if self.router == "sigmoid":  # normalized over all experts: their sum
                saved.append(("aux_score_sum", T * FP32))
            counts = E if self.load_balancing == "aux_loss" else E * sequences
            saved += [("aux_counts", counts * INDEX_BYTES), ("aux_loss", FP32)]
        return saved

    def _experts(self, T: int, D: int, es: int, moe: bool) -> list[tuple[str, int]]:
        if not moe:
            return [("n", T * D * es)] + self._mlp("mlp", T, self.dense_ffn, es)
        R = self.received_rows(T)
        saved = [("sort_index", R * INDEX_BYTES), ("expert_x", R * D * es)]
        return saved + self._mlp("expert", R, self.moe_ffn, es) + [("unsort_index", R * INDEX_BYTES)]

    def _mlp(self, prefix: str, rows: int, ffn: int, es: int) -> list[tuple[str, int]]:
        """fc1's output kept by the activation, and fc2's input; SwiGLU also keeps SiLU's output."""
        if self.gated:
            return [(f"{prefix}_fc1_out", rows * 2 * ffn * es), (f"{prefix}_silu", rows * ffn * es),
                    (f"{prefix}_act", rows * ffn * es)]  # fmt: skip
        return [(f"{prefix}_fc1_out", rows * ffn * es), (f"{prefix}_act", rows * ffn * es)]

    def _combine(self, T: int, D: int, es: int, moe: bool) -> list[tuple[str, int]]:
        if not moe:
            return []
        P, K = T * self.topk, self.topk
        # The weights unpermute multiplies by: the router's own softmax output in fp32 (top-k first), else a tensor
        # of their own (the top-k of a softmax, sigmoid weights, or a cast to the activation dtype).
        probs = ("probs", T * K * FP32) if self.router == "softmax" and es == FP32 else ("combine_probs", T * K * es)
        return [("inverse_index", P * INDEX_BYTES), ("expert_back", P * D * es), probs]

    def wgrad_held(self, node: str, T: int) -> list[tuple[str, int]]:
        """What a delayed wgrad of ``node`` ("experts" or "attention") keeps that the node did not save: its
        linears' output gradients (their inputs are the node's own saved tensors, kept too)."""
        D, es = self.hidden, self.element_bytes
        if node == "attention":
            return [("dy_proj", T * D * es), ("dy_qkv", T * self.qkv * es)]
        R = self.received_rows(T)
        return [("dy_fc2", R * D * es), ("dy_fc1", R * (2 if self.gated else 1) * self.moe_ffn * es)]


class _LayerHolds(NoComm):
    """The interpreter's runner for one layer of one unit: each compute op holds or lets go of its node's saves.
    A layer of a recomputed segment (``segment``, full recompute) saves nothing in its forward (the segment's first
    keeps its input) and everything in its replay."""

    def __init__(self, holds: UnitHolds, index: int, moe: bool, segment: tuple[int, int] | None = None):
        self.holds, self.index, self.moe, self.segment = holds, index, moe, segment
        self.delay_wgrad = False  # set per step (Step.delay_wgrad)

    def _forward(self, node: str) -> None:
        if self.segment is None:
            self.holds.forward(self.index, node)
        elif node == "pre_dispatch" and self.segment[0] == self.index:
            self.holds.keep_input(self.index)

    def compute_pre_dispatch(self, x) -> None:
        self._forward("pre_dispatch")

    def compute_experts(self) -> None:
        self._forward("experts")

    def compute_combine(self) -> None:
        self._forward("combine")

    # full recompute: the replay saves what the forward would have
    def compute_replay_input(self) -> None:
        self.holds.drop_input(self.index)

    def compute_replay_pre_dispatch(self, x) -> None:
        self.holds.forward(self.index, "pre_dispatch")

    def compute_replay_experts(self) -> None:
        self.holds.forward(self.index, "experts")

    def compute_replay_combine(self) -> None:
        self.holds.forward(self.index, "combine")

    def compute_combine_bwd(self, g) -> None:
        self.holds.backward(self.index, "combine")

    def compute_experts_bwd(self) -> None:
        if self.delay_wgrad and self.moe:
            self.holds.experts_bwd_delayed(self.index)
        else:
            self.holds.backward(self.index, "experts")

    def compute_pre_dispatch_bwd(self) -> None:
        if self.delay_wgrad:
            self.holds.pre_dispatch_bwd_delayed(self.index)
        else:
            self.holds.backward(self.index, "pre_dispatch")

    def wgrad_experts(self) -> None:
        self.holds.run_wgrad(self.index, "experts")

    def wgrad_attention(self) -> None:
        self.holds.run_wgrad(self.index, "attention")


class _ChunkHolds:
    """The interpreter's runner for one unit on its chunk: the ends' ops, and the layers' runners. A received
    activation is what the chunk's first layer saves as its input; nothing else of the P2P is held."""

    def wait_recv_activation(self) -> None: ...

    def launch_send_activation(self, x) -> None: ...

    def wait_recv_grad(self) -> None: ...

    def launch_send_grad(self, g) -> None: ...

    def __init__(self, holds: UnitHolds, chunk: ChunkShape):
        self.holds, self.chunk = holds, chunk
        self.layers = [_LayerHolds(holds, j, moe, segment_of(chunk.segments, j)) for j, moe in enumerate(chunk.moe)]

    def for_step(self, step: Step) -> "_ChunkHolds":
        for layer in self.layers:
            layer.delay_wgrad = step.delay_wgrad
        return self

    def compute_embedding(self) -> None:
        self.holds.forward(None, "embedding")

    def compute_head(self, x) -> None:
        self.holds.forward(None, "head")

    def compute_head_bwd(self) -> None:
        self.holds.backward(None, "head")

    def compute_embedding_bwd(self, g) -> None:
        self.holds.backward(None, "embedding")

    def _nodes(self) -> list[tuple[str, int | None]]:
        nodes = [("embedding", None)] if self.chunk.first else []
        nodes += [(node, layer) for layer in range(len(self.chunk.moe)) for node in _LAYER_NODES]
        return nodes + ([("head", None)] if self.chunk.last else [])

    def plain_forward(self) -> None:
        for node, layer in self._nodes():
            if layer is None or self.layers[layer].segment is None:
                self.holds.forward(layer, node)
            elif node == "pre_dispatch" and self.layers[layer].segment[0] == layer:
                self.holds.keep_input(layer)  # the checkpoint saves the segment's input

    def plain_backward(self) -> None:
        for node, layer in reversed(self._nodes()):
            segment = None if layer is None else self.layers[layer].segment
            if segment is not None and node == "combine" and layer == segment[1] - 1:  # the checkpoint's replay
                for j in range(*segment):
                    for replayed in _LAYER_NODES:
                        self.holds.forward(j, replayed)
            self.holds.backward(layer, node)
            if segment is not None and node == "pre_dispatch" and layer == segment[0]:
                self.holds.drop_input(layer)  # the checkpoint lets its input go once its backward returned


def activation_peak(shape: ActivationShape, steps: list[Step], chunk: ChunkShape) -> int:
    """The most bytes held for backward at any moment of one rank's step (``steps``, a PP = 1 program over
    ``chunk``), each step's backward deferring weight gradients as it says (``Step.delay_wgrad``)."""
    return rank_peak(shape, steps, [chunk])


def rank_peak(shape: ActivationShape, steps: list[Step], chunks: list[ChunkShape]) -> int:
    """:func:`activation_peak` of a pipeline rank: ``steps`` its program over ``chunks`` (in virtual-stage order),
    ``shape`` with each chunk's layers in ``chunks[v].moe`` (a unit on each chunk holds its own storages)."""
    count = Count()
    units: dict[tuple[int, int], _ChunkHolds] = {}
    for step in steps:
        for m in step.units:
            key = (m.unit, m.virtual)
            if key not in units:
                chunk = chunks[m.virtual]
                mine = replace(shape, moe=chunk.moe, segments=chunk.segments)
                sequences = Unit(m.microbatch, m.half).size(shape.sequences)
                units[key] = _ChunkHolds(UnitHolds(mine, count, key, m.microbatch, sequences), chunk)
        run_ops(step.ops, {m.unit: units[(m.unit, m.virtual)].for_step(step) for m in step.units})
    return count.peak


def pipeline_peaks(
    shape: ActivationShape, options, num_microbatches: int, pipeline_size: int, virtual_size: int = 1
) -> list[int]:
    """Per pipeline rank, the peak of its step (:func:`rank_peak`); ``shape.moe`` is the whole model's layers, split
    as Megatron-Core splits them (evenly; full recompute's segments at PP = 1 only)."""
    if pipeline_size == 1:
        return [predicted_peak(shape, options, num_microbatches)]
    layers = chunk_layers(len(shape.moe), pipeline_size, virtual_size)
    last = len(layers) - 1
    peaks = []
    for r in range(pipeline_size):
        chunks = [
            ChunkShape(c == 0, c == last, tuple(shape.moe[i] for i in layers[c]))
            for c in range(r, len(layers), pipeline_size)
        ]
        steps = program(options, chunks, num_microbatches, pipeline_size=pipeline_size, rank=r)
        peaks.append(rank_peak(shape, list(steps), chunks))
    return peaks


def predicted_peak(shape: ActivationShape, options, num_microbatches: int) -> int:
    """:func:`activation_peak` of the PP = 1 step of ``num_microbatches`` that ``options`` (``EPOverlapOptions``;
    ``overlap=False``: the plain path) run."""
    chunk = ChunkShape(True, True, shape.moe, shape.segments)
    return activation_peak(shape, list(program(options, [chunk], num_microbatches)), chunk)
