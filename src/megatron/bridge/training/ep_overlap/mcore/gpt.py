"""Megatron-Core models under the EP-overlap schedule: node functions for ``TransformerLayer`` and a GPTModel plan.

Contract:
    * :class:`McoreLayer` gives a Megatron-Core ``TransformerLayer`` (``MoELayer`` with the ``alltoall`` token
      dispatcher, or a dense MLP) the node functions the schedule drives, built from Megatron-Core's own
      sub-steps (supported: the installed 0.19.x line):
          pre_dispatch  ``_forward_attention``, ``_forward_pre_mlp_layernorm``, ``mlp.shared_experts_compute``,
                        ``mlp.route``, ``mlp.preprocess`` (dispatch preprocess: split counts, permute)
          dispatch      the dispatcher's tokens and probs, all-to-all'd by the schedule's comm lane with the
                        dispatcher's split sizes (what ``token_dispatch`` would do, but launched asynchronously)
          experts       ``mlp.routed_experts_compute`` (sort by local expert, experts, unsort)
          combine       all-to-all back, then ``mlp.postprocess`` and ``_forward_post_mlp`` (residual add)
      These are exactly the ops of ``TransformerLayer.forward``, so losses and gradients stay bitwise equal.
    * The dispatcher keeps one microbatch's routing state on itself between ``preprocess`` and ``postprocess``.
      Two forwards of one layer may be in flight at once (edge pairing), so each microbatch's :class:`McoreRouting`
      saves the dispatcher's attributes after each step that sets them and puts them back before the next.
    * Delayed wgrad: experts built from Transformer Engine linears offer ``backward_dw()`` and the schedule uses
      it. Megatron-Core's local linears have a ``backward_dw()`` that does nothing; their wgrad stays in the
      experts' backward. The adapter then logs one warning saying nothing is delayed (numerics are unchanged).
    * :class:`McoreGPTPlan` runs a ``GPTModel`` (embedding, decoder layers, final norm, output layer, loss), or
      one pipeline chunk of it, for :class:`~megatron.bridge.training.ep_overlap.EPOverlapEngine`. It
      needs untied embedding/output weights (``share_embeddings_and_output_weights=False``) and
      ``add_bias_linear=False``.
"""

import contextlib
import copy
import logging
from dataclasses import dataclass, field

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.moe.moe_layer import MoELayer

from megatron.bridge.training.ep_overlap.contract import IGNORE_INDEX
from megatron.bridge.training.moe_overlap_rules import use_bridge_schedule
from megatron.bridge.utils.logging import warn_rank0
from megatron.bridge.utils.process_groups import EPGroups, all_reduce

logger = logging.getLogger(__name__)


def _as_list(splits) -> list[int]:
    if isinstance(splits, torch.Tensor | np.ndarray):
        return [int(v) for v in splits.tolist()]
    return [int(v) for v in splits]


def _uses_transformer_engine(module: torch.nn.Module) -> bool:
    return any(type(m).__module__.startswith("megatron.core.extensions.transformer_engine") for m in module.modules())


@dataclass
class McoreRouting:
    """One microbatch's dispatch in one layer: split sizes read from the Megatron-Core dispatcher, and the
    dispatcher's routing state for this microbatch (its attributes, saved after each step that sets them)."""

    dispatcher: object
    state: dict = field(default_factory=dict)
    in_splits: list[int] = field(default_factory=list)
    out_splits: list[int] = field(default_factory=list)

    @contextlib.contextmanager
    def active(self):
        """The dispatcher holds this microbatch's state inside; another microbatch may use it in between."""
        self.dispatcher.__dict__.update(self.state)
        yield self.dispatcher
        self.state = dict(self.dispatcher.__dict__)


class McoreLayer:
    """Node functions for one Megatron-Core ``TransformerLayer`` (see the module docstring)."""

    def __init__(self, layer: torch.nn.Module, index: int, plan: "McoreGPTPlan"):
        self.layer, self.plan = layer, plan
        self.name = f"layer{index}"
        self.is_moe = isinstance(layer.mlp, MoELayer)
        config = layer.config
        if config.add_bias_linear:
            raise ValueError(f"{self.name}: the EP-overlap plan needs add_bias_linear=False")
        if self.is_moe and config.moe_token_dispatcher_type != "alltoall":
            raise ValueError(
                f"{self.name}: moe_token_dispatcher_type={config.moe_token_dispatcher_type!r} is not supported by the "
                "Megatron-Core plan yet; use 'alltoall'"
            )
        self.expert_wgrad_delayable = self.is_moe and _uses_transformer_engine(layer.mlp.experts)
        self.attention_wgrad_delayable = _uses_transformer_engine(layer.self_attention)

    def __call__(self, x_SBH: torch.Tensor) -> torch.Tensor:
        """The plain path: ``TransformerLayer.forward`` (what ``TransformerBlock`` runs per layer)."""
        output, _ = self.layer(
            hidden_states=x_SBH, attention_mask=self.plan.attention_mask, rotary_pos_emb=self.plan.rotary_pos_emb
        )
        return output

    def bound_to(self, context) -> "McoreLayer":
        """The same layer, reading its attention mask from ``context`` (one microbatch's) instead of the plan."""
        bound = copy.copy(self)
        bound.plan = context
        return bound

    # ---- node functions -----------------------------------------------------------------------------

    def pre_dispatch(self, x_SBH: torch.Tensor):
        layer = self.layer
        if x_SBH.dim() != 3 or x_SBH.shape[-1] != layer.config.hidden_size:
            raise ValueError(
                f"{self.name}: expected hidden states [seq, batch, {layer.config.hidden_size}], "
                f"got {tuple(x_SBH.shape)}"
            )
        h, _ = layer._forward_attention(
            hidden_states=x_SBH, attention_mask=self.plan.attention_mask, rotary_pos_emb=self.plan.rotary_pos_emb
        )
        normed = layer._forward_pre_mlp_layernorm(h)
        if isinstance(normed, tuple):
            raise ValueError(f"{self.name}: fused residual norms are not supported by the EP-overlap plan")
        if not self.is_moe:
            return h, (normed,), None, None
        mlp = layer.mlp
        shared = mlp.shared_experts_compute(normed)
        probs, routing_map = mlp.route(normed)
        tokens, permuted_probs = mlp.preprocess(normed, probs, routing_map)
        routing = McoreRouting(mlp.token_dispatcher, dict(mlp.token_dispatcher.__dict__))
        return h, (tokens, permuted_probs), shared, routing

    def start_split_exchange(self, routing: McoreRouting | None) -> None:
        """Nothing to send ahead: Megatron-Core's dispatcher exchanged the counts in ``preprocess`` (its semantics are
        kept); the device-to-host sync stays in :meth:`exchange_splits`."""

    def exchange_splits(self, routing: McoreRouting | None, *, op: str) -> None:
        """The dispatcher already exchanged split counts in preprocess; this is its device-to-host sync."""
        if routing is None:
            return
        with routing.active() as dispatcher:
            dispatcher.tokens_per_expert = dispatcher._maybe_dtoh_and_synchronize(
                "before_ep_alltoall", dispatcher.tokens_per_expert
            )
            routing.in_splits = _as_list(dispatcher.input_splits)
            routing.out_splits = _as_list(dispatcher.output_splits)

    def experts(self, received: tuple[torch.Tensor, ...], routing: McoreRouting | None) -> torch.Tensor:
        if routing is None:
            output, bias = self.layer.mlp(received[0])
            return output
        tokens, probs = received
        with routing.active():
            output, _ = self.layer.mlp.routed_experts_compute(tokens, probs)
        return output

    def combine(self, back: torch.Tensor, shared, h: torch.Tensor, routing: McoreRouting | None) -> torch.Tensor:
        if routing is None:
            output = back
        else:
            with routing.active():
                output = self.layer.mlp.postprocess(back, shared)
        return self.layer._forward_post_mlp((output, None), h)

    # ---- delayed weight gradients -------------------------------------------------------------------

    def delayable_linears(self) -> list:
        return []  # Megatron-Core modules own their delay setting (config.delay_wgrad_compute at build time)

    def expert_backward_dw(self) -> None:
        if self.is_moe:
            self.layer.mlp.backward_dw(routed_experts=True)

    def attention_backward_dw(self) -> None:
        self.layer.self_attention.backward_dw()


class McoreGPTPlan:
    """A Megatron-Core ``GPTModel`` as the EP-overlap engine runs it (the same interface as ``MoEGPTModel``).

    A pipeline chunk is a ``GPTModel`` built with its own ``pre_process``/``post_process`` and ``vp_stage``, as
    Megatron-Core builds one per virtual stage; the engine takes a rank's chunks as a list of plans.

    Args:
        model: The GPTModel, or one pipeline chunk of it.
        delay_wgrad: Whether the engine will run with delayed wgrad (for the one warning described above).
    """

    def __init__(self, model: torch.nn.Module, *, delay_wgrad: bool = False):
        # What the plan does not schedule is refused here, so no step runs it half-way.
        if not isinstance(model, GPTModel):
            raise ValueError(
                f"{type(model).__name__}: the EP-overlap plan runs Megatron-Core's GPTModel (whole or a pipeline "
                "chunk) and no other model class yet; fix: build a GPTModel, or turn overlap_moe_expert_parallel_comm "
                "off for this model"
            )
        config = model.config
        if config.mtp_num_layers:
            raise ValueError(
                f"mtp_num_layers={config.mtp_num_layers}: the EP-overlap plan does not run Megatron-Core's "
                "multi-token prediction layers yet (they would get no gradient); fix: set mtp_num_layers=None, or "
                "turn overlap_moe_expert_parallel_comm off"
            )
        if model.share_embeddings_and_output_weights:
            raise ValueError(
                "the EP-overlap plan needs share_embeddings_and_output_weights=False: a tied weight gets its two "
                "gradient contributions summed in a different order when the graph is cut into nodes"
            )
        self.pre_process, self.post_process = model.pre_process, model.post_process
        if not self.pre_process and model.position_embedding_type == "rope":
            raise ValueError(
                "position_embedding_type='rope' with pipeline stages is not supported by the EP-overlap plan yet "
                "(a chunk without the embedding would need its own rotary embedding); use PP = 1 or "
                "learned_absolute positions"
            )
        self.model, self.config = model, config
        # Megatron-Core numbers layers from 1 across the whole model.
        self.layer_numbers = [layer.layer_number - 1 for layer in model.decoder.layers]
        self.vocab_size = model.vocab_size
        self.sequence_length = model.max_sequence_length  # the plan's attention mask is built for it
        # This project's schedule runs these layers, with its own rules (fp32 included).
        use_bridge_schedule(config)
        seq = model.max_sequence_length
        device = next(model.parameters()).device
        self.attention_mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)[None, None]
        self.rotary_pos_emb = None  # set by embed(); only one microbatch's forward runs at a time
        self.layers = [McoreLayer(layer, i, self) for i, layer in zip(self.layer_numbers, model.decoder.layers)]
        if delay_wgrad:
            undelayed = [layer.name for layer in self.layers if layer.is_moe and not layer.expert_wgrad_delayable]
            if undelayed:
                warn_rank0(
                    logger,
                    "delay_wgrad_compute: the experts of %s use Megatron-Core local linears, whose backward_dw() "
                    "does nothing; their weight gradients stay in the experts' backward (nothing is delayed; "
                    "numerics are unchanged). Build the model with Transformer Engine specs to delay them.",
                    ", ".join(undelayed),
                )

    @torch.no_grad()
    def update_router_biases(self, groups: EPGroups) -> None:
        """What Megatron-Core's ``finalize_model_grads`` does for routers with ``moe_router_enable_expert_bias``:
        each training router's bias moves toward balance from the step's token counts summed over the
        tensor x data x context-parallel group, then the counts restart (the same arithmetic as its
        ``get_updated_expert_bias``, under the engine's collective timeout)."""
        routers = [
            module
            for module in self.model.modules()
            if getattr(module, "expert_bias", None) is not None
            and module.training
            and not getattr(module, "frozen_expert_bias", False)
        ]
        if not routers:
            return
        tokens_LE = torch.stack([router.local_tokens_per_expert for router in routers])
        group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
        all_reduce(tokens_LE, group, op="router expert-bias token count", timeout=groups.timeout)
        offset_LE = tokens_LE.sum(dim=-1, keepdim=True) / tokens_LE.shape[-1] - tokens_LE
        rate = self.config.moe_router_bias_update_rate
        updated_LE = torch.stack([router.expert_bias for router in routers]) + torch.sign(offset_LE) * rate
        for router, updated_E in zip(routers, updated_LE):
            router.expert_bias.copy_(updated_E)
            router.local_tokens_per_expert.zero_()

    def parameters(self):
        return self.model.parameters()

    def named_parameters(self):
        return self.model.named_parameters()

    def hidden_shape(self, tokens_BS: torch.Tensor) -> tuple[int, ...]:
        """The activation between two chunks for ``tokens_BS``'s microbatch: [seq, batch, hidden]."""
        return (tokens_BS.shape[1], tokens_BS.shape[0], self.config.hidden_size)

    def _positions(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        return torch.arange(tokens_BS.shape[1], device=tokens_BS.device)[None].expand_as(tokens_BS)

    def embed(self, tokens_BS: torch.Tensor, position_ids_BS: torch.Tensor | None = None) -> torch.Tensor:
        """``GPTModel._preprocess``: the embedding, and the rotary embedding the next forward's layers read."""
        positions = self._positions(tokens_BS) if position_ids_BS is None else position_ids_BS
        x_SBH, self.rotary_pos_emb, *_ = self.model._preprocess(input_ids=tokens_BS, position_ids=positions)
        return x_SBH

    @staticmethod
    def _masked(labels_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Labels Megatron's cross-entropy can index (ignored ones become 0) and the mask that drops them again."""
        keep_BS = labels_BS != IGNORE_INDEX
        return labels_BS.masked_fill(~keep_BS, 0), keep_BS

    def per_token_losses(self, x_SBH: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        """Final norm, output layer and cross-entropy: what ``GPTModel.forward`` returns when given labels."""
        hidden = self.model.decoder.final_layernorm(x_SBH)
        logits, _ = self.model.output_layer(hidden, weight=None)
        return self.model.compute_language_model_loss(labels_BS, logits)

    def head_loss(self, x_SBH: torch.Tensor, labels_BS: torch.Tensor, normalizer: float) -> torch.Tensor:
        labels_BS, keep_BS = self._masked(labels_BS)
        return (self.per_token_losses(x_SBH, labels_BS) * keep_BS).sum() / normalizer

    def __call__(self, tokens_BS: torch.Tensor, labels_BS: torch.Tensor, normalizer: float) -> torch.Tensor:
        """The plain path: GPTModel.forward returns per-token losses."""
        labels_BS, keep_BS = self._masked(labels_BS)
        losses = self.model(
            input_ids=tokens_BS,
            position_ids=self._positions(tokens_BS),
            attention_mask=self.attention_mask,
            labels=labels_BS,
        )
        return (losses * keep_BS).sum() / normalizer


def _gloo_pipeline_group(timeout) -> tuple[torch.distributed.ProcessGroup, tuple[int, ...]]:
    """A gloo group over this rank's pipeline (the engine's P2P matches by tag, which gloo offers): every rank
    learns every pipeline's ranks, then all create the groups in one order."""
    mine = tuple(torch.distributed.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group()))
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    group = None
    for ranks in sorted(set(everyone)):
        created = torch.distributed.new_group(list(ranks), timeout=timeout, backend="gloo")
        if ranks == mine:
            group = created
    return group, mine


def mcore_ep_groups(timeout) -> EPGroups:
    """EPGroups over Megatron-Core's initialized expert-parallel (and pipeline) groups; parallel_state must be
    initialized, and with PP > 1 every rank must call this (it creates the pipeline's gloo groups)."""
    ep_group = parallel_state.get_expert_model_parallel_group()
    ep = torch.distributed.get_world_size(ep_group)
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    pp_group, pp_ranks = _gloo_pipeline_group(timeout) if pp > 1 else (None, ())
    return EPGroups(
        ep_size=ep,
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        ep_group=ep_group,
        ep_meta_group=None,  # Megatron-Core's dispatcher exchanges split counts itself
        expert_dp_group=parallel_state.get_expert_data_parallel_group(),
        dp_group=parallel_state.get_data_parallel_group(),
        timeout=timeout,
        pp_size=pp,
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pp_group=pp_group,
        pp_ranks=pp_ranks,
    )
