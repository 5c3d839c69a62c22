"""What every Megatron-Core chunk adapter shares: the two ends, the loss, the EP groups (refusals: ``refusals.py``).

Model classes differ only in decoder stack and final norm; one MTP layer runs in the head as ``_postprocess`` does.
"""

import contextlib
import functools
from collections import deque

import torch
import torch.utils.checkpoint
from megatron.core import parallel_state
from megatron.core.transformer.multi_token_prediction import process_mtp_loss

from megatron.bridge.training.ep_overlap.contract import IGNORE_INDEX, ChunkHooks
from megatron.bridge.training.ep_overlap.mcore.graphs import mtp_layers_whole
from megatron.bridge.training.ep_overlap.mcore.layer import mtp_backward_dw
from megatron.bridge.training.ep_overlap.mcore.quantization import step_context
from megatron.bridge.training.ep_overlap.mcore.refusals import (
    check_delayed_wgrad,
    refuse_unscheduled,
)
from megatron.bridge.training.ep_overlap.settings import resolve
from megatron.bridge.training.moe_overlap_rules import use_bridge_schedule
from megatron.bridge.utils.process_groups import EPGroups


class TiedWeight:
    """A shared embedding/output weight: the head's alias gradient is added to the embedding's per microbatch."""

    def __init__(self, weight: torch.nn.Parameter):
        self.weight = weight
        self.held: deque[torch.Tensor] = deque()
        weight.register_hook(self._embedding_grad)

    def alias(self, weight: torch.Tensor | None = None) -> torch.Tensor:
        """A leaf sharing ``weight``'s storage (by default the one this was built with) whose gradient is held."""
        weight = self.weight if weight is None else weight
        alias = weight.detach().requires_grad_(weight.requires_grad)
        alias.register_hook(self._hold)
        return alias

    def _hold(self, grad: torch.Tensor) -> torch.Tensor:
        self.held.append(grad)
        return grad

    def _embedding_grad(self, grad: torch.Tensor) -> torch.Tensor | None:
        return grad + self.held.popleft() if self.held else None


@contextlib.contextmanager
def aliased_while_running(module: torch.nn.Module, aliases: dict, tied: dict):
    """While ``module`` runs, each tied parameter is swapped for this microbatch's alias only around its owning
    submodule's forward: after Megatron-FSDP's pre-forward hook gathered it (the alias is taken from the gathered
    parameter) and before its post-forward hook releases it, so FSDP's hooks only ever see its own parameters.
    ``aliases`` (name -> alias) is filled as they are made, for the head's other uses of the same weight."""
    handles = []
    for name in tied:
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name)

        def swap(owner, args, name=name, leaf=leaf):
            real = owner._parameters[leaf]
            if name not in aliases:
                aliases[name] = tied[name].alias(real)
            owner._parameters[leaf] = aliases[name]  # a plain tensor: setattr would refuse it
            restores.append((owner, leaf, real))

        handles.append(owner.register_forward_pre_hook(swap))
        handles.append(owner.register_forward_hook(lambda owner, args, out: _restore(restores, owner), prepend=True))
    restores: list = []
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        _restore(restores, None)


def _restore(restores: list, owner: torch.nn.Module | None) -> None:
    for entry in [e for e in restores if owner is None or e[0] is owner]:
        restores.remove(entry)
        entry[0]._parameters[entry[1]] = entry[2]


class _AfterBackward(torch.autograd.Function):
    """Identity; its backward runs ``then()`` once every use of its output has run its backward."""

    @staticmethod
    def forward(ctx, then, x: torch.Tensor) -> torch.Tensor:
        ctx.then = then
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.then()
        return None, grad


class McoreChunk(ChunkHooks):
    """A Megatron-Core language model (or pipeline chunk) for the engine; subclasses give :meth:`_build_layers`,
    :meth:`embed_microbatch`, :meth:`_rotary`, :meth:`_final_norm`. Per-microbatch state lives in a MicrobatchView."""

    multimodal_rotary = False
    # The forward's arguments besides the text model's that the plan binds to a microbatch (bind_inputs), by name.
    bound_inputs: tuple[str, ...] = ()

    def __init__(self, model: torch.nn.Module, *, delay_wgrad: bool = False):
        config = model.config
        self.pre_process, self.post_process = model.pre_process, model.post_process
        self.mtp = bool(config.mtp_num_layers) and getattr(model, "mtp_process", False)
        refuse_unscheduled(model, self.mtp, multimodal_rotary=self.multimodal_rotary)
        # Head uses of embedding weights get TiedWeight aliases here; a stage without the embedding holds
        # Megatron-Core's copy, which finalize_model_grads sums.
        shared = set()
        if self.pre_process and model.share_embeddings_and_output_weights and self.post_process:
            shared = {"word_embeddings.weight"}
        if self.pre_process and self.mtp:
            shared |= {name for name, _ in model.embedding.named_parameters()}
        self._tied = {name: TiedWeight(model.embedding.get_parameter(name)) for name in sorted(shared)}
        self.model, self.config = model, config
        self.vocab_size = model.vocab_size
        self.sequence_length = model.max_sequence_length
        use_bridge_schedule(config)
        device = next(model.parameters()).device
        self.packed_seq_params = None  # the plan's own calls run padded sequences; a microbatch's view may be packed
        self.rotary_pos_emb = self._rotary(torch.empty(self._received_length(), 1, 0, device=device))
        self.settings = resolve(config)
        self.layers, self.layer_numbers = self._build_layers()
        # The MTP layer is not one: Megatron-Core's MTP block checkpoints it inside the head. With 'moe' recomputed,
        # each such MoE layer is a segment of its own whose MoE part the plan replays.
        self.recompute_segments = self.settings.segments(len(self.layers)) or tuple(
            (i, i + 1) for i, layer in enumerate(self.layers) if layer.recomputes_moe
        )
        if delay_wgrad:
            check_delayed_wgrad(self.layers)

    @functools.cached_property
    def attention_mask(self) -> torch.Tensor:
        """The causal S x S mask of the plan's own whole-model calls; built on first use (a microbatch's view reads
        the driver's mask instead)."""
        seq, device = self.sequence_length, next(self.model.parameters()).device
        return torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)[None, None]

    def _build_layers(self) -> tuple[list, list[int]]:
        raise NotImplementedError

    def _final_norm(self, x_SBH: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def embed(
        self, tokens_BS: torch.Tensor, position_ids_BS: torch.Tensor | None = None, packed_seq_params=None
    ) -> torch.Tensor:
        return self.embed_microbatch(tokens_BS, position_ids_BS, packed_seq_params)[0]

    def embed_microbatch(
        self, tokens_BS: torch.Tensor, position_ids_BS: torch.Tensor | None = None, packed_seq_params=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(hidden states, rotary embedding or None)`` of one microbatch, as the model's forward computes them."""
        raise NotImplementedError

    def _rotary(self, x_SBH: torch.Tensor, packed_seq_params=None):
        raise NotImplementedError

    def parameters(self):
        return self.model.parameters()

    def named_parameters(self):
        return self.model.named_parameters()

    def hidden_shape(self, tokens_BS: torch.Tensor) -> tuple[int, ...]:
        return (tokens_BS.shape[1], tokens_BS.shape[0], self.config.hidden_size)

    def _positions(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        return torch.arange(tokens_BS.shape[1], device=tokens_BS.device)[None].expand_as(tokens_BS)

    @staticmethod
    def _masked(labels_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Labels Megatron's cross-entropy can index (ignored ones become 0) and the mask that drops them again."""
        keep_BS = labels_BS != IGNORE_INDEX
        return labels_BS.masked_fill(~keep_BS, 0), keep_BS

    def step_context(self):
        return step_context(self.config)

    def run_layers(self, x_SBH: torch.Tensor) -> torch.Tensor:
        with self.step_context():
            return super().run_layers(x_SBH)

    def start_step(self) -> None:
        """A new step: head gradients a failed step held for tied weights are dropped."""
        for tied in self._tied.values():
            tied.held.clear()

    def per_token_losses(
        self,
        x_SBH: torch.Tensor,
        labels_BS: torch.Tensor,
        tokens_BS: torch.Tensor | None = None,
        loss_mask_BS: torch.Tensor | None = None,
        microbatch: "MicrobatchView | None" = None,
    ) -> torch.Tensor:
        """The model forward's losses given labels: final norm, MTP layer and loss, output layer, cross-entropy."""
        position_ids_BS = attention_mask = packed_seq_params = None
        rotary_pos_emb = self.rotary_pos_emb
        if microbatch is not None:
            position_ids_BS, attention_mask = microbatch.position_ids, microbatch.attention_mask
            packed_seq_params, rotary_pos_emb = microbatch.packed_seq_params, microbatch.rotary_pos_emb
        model = self.model
        aliases = {}  # this microbatch's alias of each tied weight, shared by its uses in the head
        weight = None
        if model.share_embeddings_and_output_weights:
            weight = model.shared_embedding_or_output_weight()
            if "word_embeddings.weight" in self._tied:
                weight = aliases["word_embeddings.weight"] = self._tied["word_embeddings.weight"].alias()
        x_SBH = self._final_norm(x_SBH)
        if self.mtp:
            if tokens_BS is None:
                raise ValueError("the multi-token prediction layer needs the microbatch's input tokens on this chunk")
            positions = self._positions(tokens_BS) if position_ids_BS is None else position_ids_BS
            index = getattr(microbatch, "microbatch", None)
            if self.config.delay_wgrad_compute:  # the block's backward is the head's: its deferred wgrads run after
                x_SBH = _AfterBackward.apply(functools.partial(mtp_backward_dw, model.mtp, index), x_SBH)
            with mtp_layers_whole(model.mtp, index):
                x_SBH = model.mtp(
                    input_ids=tokens_BS,
                    position_ids=positions,
                    hidden_states=x_SBH,
                    attention_mask=self.attention_mask if attention_mask is None else attention_mask,
                    rotary_pos_emb=rotary_pos_emb,
                    packed_seq_params=packed_seq_params,
                    embedding=self._mtp_embedding(aliases),
                )
            x_SBH = process_mtp_loss(
                hidden_states=x_SBH,
                labels=labels_BS,
                loss_mask=loss_mask_BS,
                output_layer=model.output_layer,
                output_weight=weight,
                runtime_gather_output=None,
                is_training=model.training,
                compute_language_model_loss=model.compute_language_model_loss,
                config=self.config,
                cp_group=model.pg_collection.cp,
                tp_group=model.tp_group,
                scale_logits_fn=model._scale_logits if self.config.use_mup else None,
                input_ids=tokens_BS,
                packed_seq_params=packed_seq_params,
            )
        logits, _ = model.output_layer(x_SBH, weight=weight)
        return model.compute_language_model_loss(labels_BS, model._scale_logits(logits))

    def _mtp_embedding(self, aliases: dict):
        """The embedding the MTP block calls: the model's own module, running on this microbatch's aliases of its
        tied weights (:func:`aliased_while_running`)."""

        def embed(**inputs):
            with aliased_while_running(self.model.embedding, aliases, self._tied):
                return self.model.embedding(**inputs)

        return embed

    def head_loss(
        self,
        x_SBH: torch.Tensor,
        labels_BS: torch.Tensor,
        normalizer: float,
        tokens_BS: torch.Tensor | None = None,
        microbatch: "MicrobatchView | None" = None,
    ) -> torch.Tensor:
        labels_BS, keep_BS = self._masked(labels_BS)
        losses = self.per_token_losses(x_SBH, labels_BS, tokens_BS, keep_BS.float(), microbatch)
        return (losses * keep_BS).sum() / normalizer

    def __call__(
        self, tokens_BS: torch.Tensor, labels_BS: torch.Tensor, normalizer: float, packed_seq_params=None
    ) -> torch.Tensor:
        labels_BS, keep_BS = self._masked(labels_BS)
        losses = self.model(
            input_ids=tokens_BS,
            position_ids=self._positions(tokens_BS),
            attention_mask=self.attention_mask if packed_seq_params is None else None,
            labels=labels_BS,
            loss_mask=keep_BS.float(),
            packed_seq_params=packed_seq_params,
        )
        return (losses * keep_BS).sum() / normalizer

    def run_segment(self, first: int, stop: int, x_SBH: torch.Tensor) -> torch.Tensor:
        """A recomputed segment, under a reentrant checkpoint as Megatron-Core's block checkpoints its layers (a layer
        recomputing 'moe' checkpoints its MoE layer itself)."""
        if self.layers[first].recomputes_moe or not (torch.is_grad_enabled() and x_SBH.requires_grad):
            return self._run_units(first, stop, x_SBH)
        run = functools.partial(self._run_units, first, stop)
        return torch.utils.checkpoint.checkpoint(run, x_SBH, use_reentrant=True, preserve_rng_state=False)

    def _run_units(self, first: int, stop: int, x_SBH: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[first:stop]:
            x_SBH = layer(x_SBH)
        return x_SBH

    def input_problems(self, input_ids: torch.Tensor | None, inputs: dict, packed_seq_params=None) -> list[str]:
        """Why the plan cannot run a microbatch with ``inputs`` (by name); empty when it can."""
        return []

    def bind_inputs(self, view: "MicrobatchView", input_ids: torch.Tensor | None, inputs: dict):
        return view

    def with_packed_sequences(self, packed_seq_params) -> "MicrobatchView":
        return MicrobatchView(self, packed_seq_params=packed_seq_params)

    def rotary_for(self, packed_seq_params=None):
        """On a chunk without the embedding: the rotary embedding for one microbatch's received activation."""
        if packed_seq_params is None:
            return self.rotary_pos_emb
        device = next(self.parameters()).device
        return self._rotary(torch.empty(self._received_length(), 1, 0, device=device), packed_seq_params)

    def _received_length(self) -> int:
        """Received activation length (Megatron-Core's rotary embedding scales it back by TP size with SP, and CP)."""
        length = self.sequence_length
        if self.config.sequence_parallel:
            length //= self.config.tensor_model_parallel_size
        return length // (self.config.context_parallel_size or 1)


class MicrobatchView:
    """One microbatch's view of a plan (its inputs, rotary embedding, driver index); the plan's layers bound to it."""

    def __init__(
        self, chunk: McoreChunk, position_ids=None, attention_mask=None, packed_seq_params=None, microbatch=None
    ):
        self.chunk, self.position_ids, self.attention_mask = chunk, position_ids, attention_mask
        self.packed_seq_params, self.microbatch = packed_seq_params, microbatch
        self.rotary_pos_emb = None if chunk.pre_process else chunk.rotary_for(packed_seq_params)
        self.layers = [layer.bound_to(self) for layer in chunk.layers]

    def __getattr__(self, name: str):
        return getattr(self.chunk, name)

    def embed(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        x_SBH, self.rotary_pos_emb = self.chunk.embed_microbatch(tokens_BS, self.position_ids, self.packed_seq_params)
        return x_SBH

    def head_loss(self, x_SBH, labels_BS, normalizer: float, tokens_BS=None) -> torch.Tensor:
        return self.chunk.head_loss(x_SBH, labels_BS, normalizer, tokens_BS, self)

    def __call__(self, tokens_BS, labels_BS, normalizer: float) -> torch.Tensor:
        return self.chunk(tokens_BS, labels_BS, normalizer, self.packed_seq_params)


def gloo_group_like(group, timeout) -> tuple[torch.distributed.ProcessGroup, tuple[int, ...]]:
    """A gloo group over the ranks of ``group`` (one of Megatron-Core's); every rank must call it."""
    mine = tuple(torch.distributed.get_process_group_ranks(group))
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    found = None
    for ranks in sorted(set(everyone)):
        created = torch.distributed.new_group(list(ranks), timeout=timeout, backend="gloo")
        if ranks == mine:
            found = created
    return found, mine


def mcore_ep_groups(timeout) -> EPGroups:
    """``EPGroups`` over Megatron-Core's groups (no collective). No pipeline group: Megatron-Core's driver sends
    between stages itself."""
    ep_group = parallel_state.get_expert_model_parallel_group()
    ep = torch.distributed.get_world_size(ep_group)
    return EPGroups(
        ep_size=ep,
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        ep_group=ep_group,
        ep_meta_group=None,  # Megatron-Core's dispatcher exchanges split counts itself
        expert_dp_group=parallel_state.get_expert_data_parallel_group(),
        dp_group=parallel_state.get_data_parallel_group(),
        timeout=timeout,
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
    )
