"""Reference MoE GPT in plain PyTorch, with each transformer layer split into the four nodes of the EP schedule.

Contract:
    * ``MoEGPTModel(config, groups, seed)`` builds token + learned position embeddings, ``num_layers`` layers
      (causal self-attention, multi-head or grouped-query, then a dense or MoE MLP chosen by ``moe_layer_freq``),
      a final norm (LayerNorm or RMSNorm, as each layer's two) and an
      untied LM head. Untied on purpose: a weight used twice in one backward would be summed differently by
      plain autograd and by the node-by-node backward, and break bitwise equality.
    * A layer exposes the node functions the overlap schedule calls, and ``forward`` composes exactly the same
      functions with a blocking differentiable all-to-all (the plain path). Both paths therefore run the same
      kernels on the same operands:
          pre_dispatch(x)            -> h, tokens, kept, routing    (attention, norm, shared experts, router, permute)
          all-to-all(tokens)         -> received                    (dispatch; identity for dense layers)
          experts(received, routing) -> expert_out                  (sort by local expert, grouped GEMMs, unsort)
          all-to-all(expert_out)     -> back                        (combine; identity for dense layers)
          combine(back, kept, h, routing) -> layer output           (unpermute weighted by probs, + shared, + h)
    * Dense weights are identical on every rank: each layer's are drawn from a generator keyed by ``seed`` and
      the layer's global number (the embeddings' and the head's by their own keys); expert e's weights depend
      only on ``seed``, the layer and e. So a model is the same whatever the EP or pipeline layout. Expert
      parameters carry ``allreduce = False`` (as in Megatron): they are reduced over the expert-DP group, not the
      DP group.
    * Pipeline chunks: ``layer_numbers`` picks the global layers a chunk holds; ``pre_process`` (the embeddings)
      and ``post_process`` (final norm, head and loss) say whether it is the model's first and/or last chunk, as
      Megatron-Core's ``GPTModel`` does. :func:`build_pipeline_chunks` builds a pipeline rank's chunks.
    * The router scores experts as Megatron-Core's does: softmax (before or after top-k) or sigmoid. With
      ``moe_router_enable_expert_bias`` (sigmoid only) a per-expert bias chooses the experts without weighting
      them; training forwards count the tokens each expert gets, and :meth:`MoEGPTModel.update_router_biases`
      (called by the engine once per training step) moves the bias toward balance, as Megatron-Core's
      aux-loss-free load balancing does. Every path and schedule counts the same tokens, so the biases stay
      bitwise equal too.
    * Router losses (``router_losses.py``): the z-loss (``moe_z_loss_coeff``) and the load-balancing loss
      (``moe_router_load_balancing_type`` ``aux_loss`` or ``seq_aux_loss`` with ``moe_aux_loss_coeff``), as
      Megatron-Core computes them; under the engine :meth:`MoEGPTModel.start_step` sets their backward scale per
      step. Used directly (outside an engine step), a model gives them whatever scale the process holds.
    * Shared experts (``moe_shared_expert_intermediate_size``): an MLP of that width on the router's input, whose
      output is added to the routed experts' before the residual, as Megatron-Core's ``MoELayer`` adds it.
    * No biases (``add_bias_linear`` is not supported by the reference model).

Shape suffixes: B microbatch size, S sequence, T = B*S tokens, D hidden, H heads, F FFN hidden, V vocab,
K top-k, P = T*K permuted slots, R received rows, E experts.
"""

import functools
import math

import torch
import torch.nn.functional as F

from ep_overlap_lab.collectives import all_reduce
from ep_overlap_lab.moe_gpt import recompute
from ep_overlap_lab.moe_gpt.attention import Attention, Linear, activation, norm
from ep_overlap_lab.moe_gpt.config import MoEGPTConfig, refuse_unbuildable, router_problems
from ep_overlap_lab.moe_gpt.grouped_linear import GroupedLinear, make_expert_linear
from ep_overlap_lab.moe_gpt.router_losses import RouterLosses
from ep_overlap_lab.moe_gpt.token_dispatcher import (
    CommObserver,
    Routing,
    all_to_all_with_grad,
    exchange_splits,
    permute,
    replay_splits,
    start_split_exchange,
    unpermute,
)
from ep_overlap_lab.multiprocess import single_process_groups
from ep_overlap_lab.pipeline_layout import chunk_layers_of
from ep_overlap_lab.step_loss import StepHooks, StepLoss, StepScales, backward_scales
from megatron.bridge.training.ep_overlap.contract import ChunkHooks, LayerHooks, PreDispatch
from megatron.bridge.training.ep_overlap.settings import resolve
from megatron.bridge.utils.process_groups import EPGroups


class TransformerLayer(LayerHooks, torch.nn.Module):
    """One layer: attention and a dense or MoE MLP, split into the schedule's node functions."""

    replays_forward = True  # full recompute: a replay reuses the first forward's split sizes (replay_splits)

    def __init__(self, config: MoEGPTConfig, layer_number: int, groups: EPGroups):
        super().__init__()
        name = f"layer{layer_number}"
        D = config.hidden_size
        self.name = name
        self.groups = groups
        self.is_moe = config.is_moe_layer(layer_number)
        # exchange_splits touches only its routing and the EP metadata group: a lane may run it off the host thread.
        self.exchange_splits_off_host = True
        # Set by the engine while it runs the plain path, to time the blocking all-to-alls.
        self.comm_observer: CommObserver | None = None
        self.replaying = False  # full recompute's replay in the plain path: its forward's comm is named replay_*
        self.gated = config.gated_linear_unit
        self.recompute = recompute.recompute_modules(config)
        self.ln1 = norm(config, D)
        self.attention = Attention(config, f"{name}.attention")
        self.ln2 = norm(config, D)
        # What only an MoE layer has (its router's losses, its expert bias and token count): None in a dense one.
        self.router_losses = None
        self.expert_bias_E = self.tokens_per_expert_E = None
        if self.is_moe:
            self._build_experts(config, groups)
        else:
            Fd = config.ffn_hidden_size
            self.fc1 = Linear(D, 2 * Fd if self.gated else Fd, name=f"{name}.mlp.fc1")
            self.fc2 = Linear(Fd, D, name=f"{name}.mlp.fc2")

    def _build_experts(self, config: MoEGPTConfig, groups: EPGroups) -> None:
        """An MoE layer's router, routed experts (and their bias, losses) and shared experts."""
        name, D = self.name, config.hidden_size
        E, ep = config.num_moe_experts, groups.ep_size
        if E % ep:
            raise ValueError(f"{name}: num_moe_experts={E} is not divisible by expert_model_parallel_size={ep}")
        self.num_experts, self.topk = E, config.moe_router_topk
        self.pre_softmax = config.moe_router_pre_softmax
        if not 1 <= self.topk <= E:
            raise ValueError(f"{name}: moe_router_topk={self.topk} must be between 1 and num_moe_experts={E}")
        self.score_function = config.moe_router_score_function
        problems = router_problems(config)
        if problems:
            raise ValueError(f"{name}: " + "; ".join(problems))
        # Aux-loss-free load balancing: a per-expert bias added to the scores for choosing experts only, moved
        # after each training step toward the experts that got fewer tokens (update_router_biases). Kept in
        # fp32 whatever the model dtype, as Megatron-Core does, so small updates are not rounded away.
        self.bias_update_rate = config.moe_router_bias_update_rate
        if config.moe_router_enable_expert_bias:
            del self.expert_bias_E, self.tokens_per_expert_E  # plain attributes until now; buffers from here
            self.register_buffer("expert_bias_E", torch.zeros(E, dtype=torch.float32))
            self.register_buffer("tokens_per_expert_E", torch.zeros(E, dtype=torch.int64), persistent=False)
        Fe = config.moe_ffn_hidden_size or config.ffn_hidden_size
        self.fc2_in = Fe
        self.router = torch.nn.Linear(D, E, bias=False)
        self.router_losses = RouterLosses.of(config)
        expert_linear = functools.partial(
            make_expert_linear,
            use_transformer_engine=config.moe_grouped_gemm,
            delay_wgrad=config.delay_wgrad_compute,
            dtype=config.activation_dtype(),
        )
        self.fc1 = expert_linear(E // ep, D, 2 * Fe if self.gated else Fe, name=f"{name}.experts.fc1")
        self.fc2 = expert_linear(E // ep, Fe, D, name=f"{name}.experts.fc2")
        for param in self.fc1.group_weights + self.fc2.group_weights:
            param.allreduce = False
        # Shared experts (Megatron-Core's SharedExpertMLP): an MLP every token goes through, on the same norm
        # output as the router; their output is added to the routed experts' before the residual.
        Fs = config.moe_shared_expert_intermediate_size
        if Fs:
            self.shared_fc1 = Linear(D, 2 * Fs if self.gated else Fs, name=f"{name}.shared_experts.fc1")
            self.shared_fc2 = Linear(Fs, D, name=f"{name}.shared_experts.fc2")
        self.has_shared_experts = bool(Fs)

    # ---- node functions (the interface the EP-overlap schedule drives; see training/ep_overlap/contract.py) ----

    def pre_dispatch(self, x_TD: torch.Tensor) -> PreDispatch:
        """Attention, pre-MLP norm, shared experts, router (and its auxiliary losses), permute.

        Returns:
            The residual h; to dispatch, the permuted tokens; kept for combine, the router probs and the shared
            experts' output; the routing (None for dense layers).
        """
        if x_TD.dim() != 2 or x_TD.shape[-1] != self.ln1.normalized_shape[0]:
            raise ValueError(
                f"{self.name}: expected hidden states [tokens, {self.ln1.normalized_shape[0]}], "
                f"got {tuple(x_TD.shape)}"
            )
        norms = "layernorm" in self.recompute
        norm1 = recompute.OutputRecompute(norms)
        qkv_TQ = self.attention.qkv(norm1.run(self.ln1, x_TD))
        norm1.discard(qkv_TQ)
        h_TD = x_TD + self.attention.attend(qkv_TQ)
        if not self.is_moe:  # the norm's output crosses to the experts node, so only its statistics are dropped
            return PreDispatch(h_TD, (recompute.run(norms, self.ln2, h_TD),), None, None)
        norm2 = recompute.OutputRecompute(norms)
        n_TD = norm2.run(self.ln2, h_TD)
        keep = ()
        readers = ()  # outputs of the linears that saved the norm's output as their input
        if self.has_shared_experts:
            shared_in_TF = self.shared_fc1(n_TD)
            keep, readers = (self.shared_fc2(activation(shared_in_TF, self.gated)),), (shared_in_TF,)
        logits_TE = self.router(n_TD)
        losses = self.router_losses if self.training and torch.is_grad_enabled() else None
        scored_TE = logits_TE if losses is None else losses.with_z_loss(logits_TE)
        probs_TK, experts_TK = self._route(scored_TE)
        if losses is not None:
            probs_TK = losses.with_load_balancing(probs_TK, scored_TE)
        probs_TK = probs_TK.to(n_TD.dtype)
        routing = Routing.build(experts_TK, self.num_experts, self.groups.ep_size)
        if self.tokens_per_expert_E is not None and torch.is_grad_enabled():  # training forwards only
            self.tokens_per_expert_E += routing.counts_E
        permuted_PD = permute(n_TD, routing, self.topk)
        norm2.discard(logits_TE, *readers)  # the permute's backward does not read the norm's output
        return PreDispatch(h_TD, (permuted_PD,), (probs_TK, *keep), routing)

    def _route(self, logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k experts per token and their weights, with Megatron-Core's score functions (in fp32)."""
        K = self.topk
        if self.score_function == "sigmoid":
            scores_TE = torch.sigmoid(logits_TE.float())
            if self.expert_bias_E is None:
                probs_TK, experts_TK = torch.topk(scores_TE, K, dim=-1)
            else:  # the bias chooses the experts; the weights stay the unbiased scores
                experts_TK = torch.topk(scores_TE + self.expert_bias_E, K, dim=-1).indices
                probs_TK = scores_TE.gather(1, experts_TK)
            return (probs_TK / (probs_TK.sum(dim=-1, keepdim=True) + 1e-20) if K > 1 else probs_TK), experts_TK
        if self.pre_softmax:  # softmax over all experts, then keep the top-k probabilities
            return torch.topk(torch.softmax(logits_TE.float(), dim=-1), K, dim=-1)
        top_logits_TK, experts_TK = torch.topk(logits_TE, K, dim=-1)  # top-k logits, then softmax over them
        return torch.softmax(top_logits_TK.float(), dim=-1), experts_TK

    def replay_splits(self, routing: Routing | None, exchanged) -> None:
        """A replayed forward (full recompute): its routing takes the split sizes its first forward exchanged
        (``token_dispatcher.replay_splits``; no-op for dense layers)."""
        if routing is not None:
            replay_splits(routing, exchanged, where=self.name)

    def start_split_exchange(self, routing: Routing | None) -> None:
        """Sends the split sizes ahead without blocking the host (no-op for dense layers)."""
        if routing is not None:
            start_split_exchange(routing, self.groups)

    def exchange_splits(self, routing: Routing | None, *, op: str) -> None:
        """Host sync of the dispatch: split sizes for both all-to-alls (no-op for dense layers)."""
        if routing is not None:
            exchange_splits(routing, self.groups, op=op, observer=self._observer())

    def experts(self, received: tuple[torch.Tensor, ...], routing: Routing | None) -> torch.Tensor:
        """Local experts (grouped GEMMs) on the received rows; the dense MLP for dense layers."""
        (received_RD,) = received
        if routing is None:
            return recompute.run("mlp" in self.recompute, self._dense_mlp, received_RD)
        return recompute.run("moe" in self.recompute, functools.partial(self._experts, routing), received_RD)

    def _dense_mlp(self, n_TD: torch.Tensor) -> torch.Tensor:
        return self.fc2(activation(self.fc1(n_TD), self.gated))

    def _experts(self, routing: Routing, received_RD: torch.Tensor) -> torch.Tensor:
        sizes = routing.local_group_sizes
        x_RD = received_RD.index_select(0, routing.sort_R)
        act = recompute.OutputRecompute("moe_act" in self.recompute)
        a_RF = act.run(functools.partial(activation, gated=self.gated), self.fc1(x_RD, sizes))
        y_RD = self.fc2(a_RF, sizes)
        act.discard(y_RD)  # fc2's input
        return y_RD.index_select(0, routing.unsort_R)

    def combine(
        self, back_PD: torch.Tensor, keep: tuple[torch.Tensor, ...] | None, h_TD: torch.Tensor, routing: Routing | None
    ) -> torch.Tensor:
        """Unpermute weighted by router probs, add the shared experts' output, then the residual."""
        if routing is None:
            return h_TD + back_PD
        probs_TK, *shared = keep
        out_TD = unpermute(back_PD, probs_TK, routing)
        return h_TD + (out_TD + shared[0] if shared else out_TD)

    # ---- delayed weight gradients -------------------------------------------------------------------

    def delayable_linears(self) -> list[GroupedLinear]:
        """Linears whose wgrad the schedule may defer: attention projections, and MoE experts."""
        return [self.attention.qkv, self.attention.proj] + ([self.fc1, self.fc2] if self.is_moe else [])

    def expert_backward_dw(self) -> None:
        if self.is_moe:
            self.fc1.backward_dw()
            self.fc2.backward_dw()

    def attention_backward_dw(self) -> None:
        self.attention.qkv.backward_dw()
        self.attention.proj.backward_dw()

    # ---- plain path -----------------------------------------------------------------------------------

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        h_TD, (tokens_PD,), keep, routing = self.pre_dispatch(x_TD)
        if routing is None:
            return self.combine(self.experts((tokens_PD,), None), None, h_TD, None)
        self.exchange_splits(routing, op=f"{self.name} split exchange")
        received_RD = all_to_all_with_grad(
            tokens_PD, routing.out_splits, routing.in_splits, self.groups, op="dispatch", where=self.name,
            observer=self._observer(),
        )  # fmt: skip
        out_RD = self.experts((received_RD,), routing)
        back_PD = all_to_all_with_grad(
            out_RD, routing.in_splits, routing.out_splits, self.groups, op="combine", where=self.name,
            observer=self._observer(),
        )  # fmt: skip
        return self.combine(back_PD, keep, h_TD, routing)

    def _observer(self) -> CommObserver | None:
        """The comm observer; in a replay its forward all-to-alls are ``replay_<op>`` (their backward keeps its name:
        it is the layer's one backward)."""
        observer = self.comm_observer
        if observer is None or not self.replaying:
            return observer
        return lambda op, *event: observer(op if op.endswith("_bwd") else f"replay_{op}", *event)


def _generator(seed: int, *key: int) -> torch.Generator:
    """A generator keyed by ``seed`` and ``key`` (layer number, expert, ...), the same in every process."""
    value = seed
    for k in key:
        value = (value * 1_000_003 + k + 17) % (2**63 - 1)
    return torch.Generator().manual_seed(value)


EMBEDDING_KEY, HEAD_KEY = -1, -2  # generator keys of the non-layer weights


class MoEGPTModel(ChunkHooks, StepHooks, torch.nn.Module):
    """Embedding, transformer layers, final norm, untied LM head and token-summed cross-entropy.

    Args:
        config: Shapes and options (Megatron field names).
        groups: This rank's process groups (EP = 1 without).
        seed: Weight seed; the same seed gives the same model under every layout.
        layer_numbers: Global numbers of the layers this chunk holds (all layers by default).
        pre_process: Whether this chunk holds the embeddings (the model's first chunk).
        post_process: Whether it holds final norm, head and loss (the model's last chunk).
    """

    def __init__(
        self,
        config: MoEGPTConfig,
        groups: EPGroups | None = None,
        seed: int = 1234,
        *,
        layer_numbers: list[int] | None = None,
        pre_process: bool = True,
        post_process: bool = True,
    ):
        super().__init__()
        groups = groups or single_process_groups()
        refuse_unbuildable(config, groups.ep_size)
        self.config = config
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_numbers = list(range(config.num_layers)) if layer_numbers is None else list(layer_numbers)
        D = config.hidden_size
        if pre_process:
            self.word_embeddings = torch.nn.Embedding(config.vocab_size, D)
            self.position_embeddings = torch.nn.Embedding(config.seq_length, D)
        self.layers = torch.nn.ModuleList(TransformerLayer(config, i, groups) for i in self.layer_numbers)
        self.recompute_segments = resolve(config).segments(len(self.layers))
        if post_process:
            self.final_ln = norm(config, D)
            self.output_layer = torch.nn.Linear(D, config.vocab_size, bias=False)
        self._initialize(seed, groups)
        self._scales = StepScales()  # the router losses' backward scale of an engine step, until finish_step
        self.to(config.activation_dtype())
        for layer in self.layers:
            if layer.expert_bias_E is not None:
                layer.expert_bias_E.data = layer.expert_bias_E.data.float()

    @torch.no_grad()
    def _initialize(self, seed: int, groups: EPGroups) -> None:
        std = self.config.init_method_std
        parts = [(EMBEDDING_KEY, self, ("word_embeddings", "position_embeddings")) if self.pre_process else None]
        parts += [(number, layer, None) for number, layer in zip(self.layer_numbers, self.layers)]
        parts += [(HEAD_KEY, self, ("final_ln", "output_layer")) if self.post_process else None]
        for key, module, children in filter(None, parts):
            dense = _generator(seed, key)
            for name, param in module.named_parameters():
                if children is not None and not name.startswith(children):
                    continue
                if getattr(param, "allreduce", True) is False:
                    continue
                if param.dim() == 1:  # norms
                    param.fill_(1.0 if name.endswith("weight") else 0.0)
                else:
                    # Output projections scaled by depth, as Megatron's scaled_init_method_normal does.
                    is_output = name.endswith(("proj.weight", "fc2.weight"))
                    scale = 1.0 / math.sqrt(2 * self.config.num_layers) if is_output else 1.0
                    param.copy_(torch.randn(param.shape, generator=dense) * std * scale)
        for layer_number, layer in zip(self.layer_numbers, self.layers):
            if not layer.is_moe:
                continue
            local = self.config.num_moe_experts // groups.ep_size
            D, Fe = self.config.hidden_size, layer.fc2_in
            shapes = ((D, 2 * Fe if layer.gated else Fe), (Fe, D))
            for which, (fc, shape) in enumerate(zip((layer.fc1, layer.fc2), shapes)):
                for le in range(local):
                    gen = _generator(seed, layer_number, groups.ep_rank * local + le, which)
                    fc.load_group_weight(le, torch.randn(shape, generator=gen) * std)

    def start_step(self, loss: StepLoss) -> None:
        """An engine step starts: the router losses' backward scale is set as Megatron-Core's ``forward_step`` and its
        DDP weigh them (``step_loss.backward_scales``); :meth:`finish_step` puts back what it found."""
        if any(layer.router_losses is not None for layer in self.layers):
            mtp, moe = backward_scales(loss, per_token=self.config.calculate_per_token_loss)
            self._scales.set(mtp, moe, next(self.parameters()).device)

    def finish_step(self) -> None:
        self._scales.restore()

    @torch.no_grad()
    def update_router_biases(self, groups: EPGroups) -> None:
        """After a training step's gradient sync: moves each expert's routing bias by ``moe_router_bias_update_rate``
        toward balance, from the tokens it got over the step on every data-parallel rank (Megatron-Core's
        aux-loss-free update; every rank computes the same biases). No-op without ``moe_router_enable_expert_bias``.
        """
        layers = [layer for layer in self.layers if layer.expert_bias_E is not None]
        if not layers:
            return
        tokens_LE = torch.stack([layer.tokens_per_expert_E for layer in layers]).float()
        if groups.dp_group is not None and torch.distributed.get_world_size(groups.dp_group) > 1:
            all_reduce(tokens_LE, groups.dp_group, op="router expert-bias token count", timeout=groups.timeout)
        offset_LE = tokens_LE.sum(dim=-1, keepdim=True) / tokens_LE.shape[-1] - tokens_LE
        for layer, offset_E in zip(layers, offset_LE):
            layer.expert_bias_E += torch.sign(offset_E) * layer.bias_update_rate
            layer.tokens_per_expert_E.zero_()

    def global_named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """``named_parameters`` with each layer's global number (``layers.<global>.``): equal under any layout."""
        named = []
        for name, param in self.named_parameters():
            if name.startswith("layers."):
                _, local, rest = name.split(".", 2)
                name = f"layers.{self.layer_numbers[int(local)]}.{rest}"
            named.append((name, param))
        return named

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def sequence_length(self) -> int:
        """The one sequence length the learned position embedding and the attention take."""
        return self.config.seq_length

    def embed(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """Token + position embeddings, flattened to [T, D]."""
        B, S = tokens_BS.shape
        if S != self.config.seq_length:
            raise ValueError(f"embedding: got sequences of length {S}, config.seq_length={self.config.seq_length}")
        positions_S = torch.arange(S, device=tokens_BS.device)
        x_BSD = self.word_embeddings(tokens_BS) + self.position_embeddings(positions_S)
        return x_BSD.reshape(B * S, -1)

    def head_loss(
        self, x_TD: torch.Tensor, labels_BS: torch.Tensor, normalizer: float, tokens_BS: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final norm, LM head, cross-entropy summed over tokens and divided by ``normalizer`` (``tokens_BS`` is not
        read: this head predicts one token).

        Labels of -100 (``F.cross_entropy``'s default ``ignore_index``) add nothing to the sum.
        """
        logits_TV = self.output_layer(self.final_ln(x_TD))
        return F.cross_entropy(logits_TV.float(), labels_BS.reshape(-1), reduction="sum") / normalizer

    def forward(self, tokens_BS: torch.Tensor, labels_BS: torch.Tensor, normalizer: float) -> torch.Tensor:
        """The plain path: the whole microbatch through ordinary autograd (a whole model, not a chunk)."""
        return self.head_loss(self.run_layers(self.embed(tokens_BS)), labels_BS, normalizer)

    def run_segment(self, first: int, stop: int, x_TD: torch.Tensor) -> torch.Tensor:
        """A recomputed segment of the plain path (``run_layers``): a reentrant checkpoint keeps only its input. Its
        first forward builds no graph, so the router counts tokens and builds its losses once, in the replay, as the
        overlapped schedule's replay does."""
        return recompute.run(True, functools.partial(self._replayable, first, stop), x_TD)

    def _replayable(self, first: int, stop: int, x_TD: torch.Tensor) -> torch.Tensor:
        replaying = torch.is_grad_enabled()  # the reentrant checkpoint's first forward runs without grad
        for layer in self.layers[first:stop]:
            layer.replaying = replaying
            try:
                x_TD = layer(x_TD)
            finally:
                layer.replaying = False
        return x_TD

    def hidden_shape(self, tokens_BS: torch.Tensor) -> tuple[int, ...]:
        """Shape of the activation between two chunks, for ``tokens_BS``'s microbatch: [tokens, hidden]."""
        return (tokens_BS.numel(), self.config.hidden_size)


def build_pipeline_chunks(config: MoEGPTConfig, groups: EPGroups, seed: int, pipeline_rank: int) -> list[MoEGPTModel]:
    """The model chunks of ``pipeline_rank``, one per virtual stage, split as Megatron-Core splits the model."""
    layers = chunk_layers_of(config)
    P = config.pipeline_model_parallel_size or 1
    last = len(layers) - 1
    return [
        MoEGPTModel(
            config,
            groups,
            seed,
            layer_numbers=layers[c],
            pre_process=c == 0,
            post_process=c == last,
        )
        for c in range(pipeline_rank, len(layers), P)
    ]
