"""What every Megatron-Core plan shares: the refusals, the two ends, the loss, the router biases, the EP groups.

A plan is a Megatron-Core language model (or one pipeline chunk of it) as
:class:`~megatron.bridge.training.ep_overlap.EPOverlapEngine` runs it (the ``ChunkModel`` contract). The model
classes differ in their decoder stack and final norm; :class:`McorePlan` holds the rest. Everything the plan does
not schedule is refused when it is built, so no step runs it half-way. A weight tied between the embedding and the
output layer (PP = 1) gets its two gradients summed as plain autograd sums them (:class:`TiedWeight`).
"""

import logging
from collections import deque

import torch
from megatron.core import parallel_state

from megatron.bridge.training.ep_overlap.contract import IGNORE_INDEX
from megatron.bridge.training.moe_overlap_rules import use_bridge_schedule
from megatron.bridge.utils.logging import warn_rank0
from megatron.bridge.utils.process_groups import EPGroups, all_reduce

logger = logging.getLogger(__name__)

_OFF = "or turn overlap_moe_expert_parallel_comm off for this model"


class TiedWeight:
    """A weight the embedding and the output layer share, with its two gradients summed as plain autograd sums them.

    In one backward, autograd adds the output layer's and the embedding's gradient of a microbatch (``o + e``), then
    accumulates that sum into ``.grad``. Cut into nodes, the head's backward and the embedding's run apart, with
    other microbatches' in between, so adding each to ``.grad`` on its own would sum in another order. So the head
    computes with an alias of the weight whose gradient is held here (in backward order), and the weight's own hook
    adds the oldest held one to the embedding's gradient: ``e + o``, the same bits. With nothing held (the plain
    path) the hook changes nothing.
    """

    def __init__(self, weight: torch.nn.Parameter):
        self.weight = weight
        self.held: deque[torch.Tensor] = deque()
        weight.register_hook(self._embedding_grad)

    def alias(self) -> torch.Tensor:
        """The weight for one microbatch's head: same data, its gradient held instead of accumulated."""
        alias = self.weight.detach().requires_grad_(self.weight.requires_grad)
        alias.register_hook(self._hold)
        return alias

    def _hold(self, grad: torch.Tensor) -> torch.Tensor:
        self.held.append(grad)
        return grad

    def _embedding_grad(self, grad: torch.Tensor) -> torch.Tensor | None:
        return grad + self.held.popleft() if self.held else None


class McorePlan:
    """A Megatron-Core language model (or a pipeline chunk) for the engine. Subclasses set ``layers`` (the
    schedule's units) and ``layer_numbers`` in :meth:`_build_units`, and give :meth:`embed` and :meth:`_final_norm`.

    Args:
        model: The model, or one pipeline chunk of it (built with its own ``pre_process``/``post_process`` and
            ``vp_stage``, as Megatron-Core builds one per virtual stage).
        delay_wgrad: Whether the engine will run with delayed wgrad (for the one warning below).
    """

    def __init__(self, model: torch.nn.Module, *, delay_wgrad: bool = False):
        config = model.config
        if config.mtp_num_layers:
            raise ValueError(
                f"mtp_num_layers={config.mtp_num_layers}: the EP-overlap plan does not run Megatron-Core's "
                f"multi-token prediction layers yet (they would get no gradient); fix: set mtp_num_layers=None, {_OFF}"
            )
        self.pre_process, self.post_process = model.pre_process, model.post_process
        self._tied = None
        if model.share_embeddings_and_output_weights:
            if not (self.pre_process and self.post_process):
                raise ValueError(
                    "share_embeddings_and_output_weights=True with pipeline stages: the EP-overlap plan ties the two "
                    "uses of the weight only where one chunk holds both (PP = 1); fix: set "
                    f"share_embeddings_and_output_weights=False or PP = 1, {_OFF}"
                )
            self._tied = TiedWeight(model.shared_embedding_or_output_weight())
        if not self.pre_process and model.position_embedding_type in ("rope", "yarn"):
            raise ValueError(
                f"position_embedding_type={model.position_embedding_type!r} with pipeline stages is not supported by "
                "the EP-overlap plan yet (a chunk without the embedding would need its own rotary embedding); fix: "
                f"use PP = 1 or learned_absolute positions, {_OFF}"
            )
        self.model, self.config = model, config
        self.vocab_size = model.vocab_size
        self.sequence_length = model.max_sequence_length  # the plan's attention mask is built for it
        use_bridge_schedule(config)  # this project's schedule runs these layers, with its own rules (fp32 included)
        seq = model.max_sequence_length
        device = next(model.parameters()).device
        self.attention_mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)[None, None]
        self.rotary_pos_emb = None  # set by embed(); only one microbatch's forward runs at a time
        self.layers, self.layer_numbers = self._build_units()
        if delay_wgrad:
            undelayed = [unit.name for unit in self.layers if unit.is_moe and not unit.expert_wgrad_delayable]
            if undelayed:
                warn_rank0(
                    logger,
                    "delay_wgrad_compute: the experts of %s use Megatron-Core local linears, whose backward_dw() "
                    "does nothing; their weight gradients stay in the experts' backward (nothing is delayed; "
                    "numerics are unchanged). Build the model with Transformer Engine specs to delay them.",
                    ", ".join(undelayed),
                )

    def _build_units(self) -> tuple[list, list[int]]:
        raise NotImplementedError

    def _final_norm(self, x_SBH: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def embed(self, tokens_BS: torch.Tensor, position_ids_BS: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

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

    @staticmethod
    def _masked(labels_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Labels Megatron's cross-entropy can index (ignored ones become 0) and the mask that drops them again."""
        keep_BS = labels_BS != IGNORE_INDEX
        return labels_BS.masked_fill(~keep_BS, 0), keep_BS

    def start_step(self) -> None:
        """A new step: a tied weight's head gradients held by a step that failed are dropped."""
        if self._tied is not None:
            self._tied.held.clear()

    def per_token_losses(self, x_SBH: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        """Final norm, output layer and cross-entropy: what the model's forward returns when given labels."""
        weight = None if self._tied is None else self._tied.alias()
        logits, _ = self.model.output_layer(self._final_norm(x_SBH), weight=weight)
        return self.model.compute_language_model_loss(labels_BS, self.model._scale_logits(logits))

    def head_loss(self, x_SBH: torch.Tensor, labels_BS: torch.Tensor, normalizer: float) -> torch.Tensor:
        labels_BS, keep_BS = self._masked(labels_BS)
        return (self.per_token_losses(x_SBH, labels_BS) * keep_BS).sum() / normalizer

    def __call__(self, tokens_BS: torch.Tensor, labels_BS: torch.Tensor, normalizer: float) -> torch.Tensor:
        """The plain path: the model's own forward returns per-token losses."""
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
