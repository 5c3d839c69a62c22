"""What the engine does around each step of a chunk that Megatron-Core's driver, DDP and ``finalize_model_grads`` do
under Bridge: the lab's trainer duties, kept out of the payload (``megatron.bridge``), which leaves them to
Megatron-Core.

Contract:
    * :func:`step_hooks` gives a chunk's hooks: its own where it inherits ``step_loss.StepHooks``,
      :class:`McoreStepHooks` for a Megatron-Core plan (``megatron.bridge.training.ep_overlap.mcore``), no-ops
      otherwise.
    * :class:`McoreStepHooks` refuses what only Megatron-Core's driver does (:func:`layout_problems` when built,
      :func:`step_problems` at each step), sets the auxiliary-loss scales per step (``step_loss.py``), sums the
      gradients of a weight held on two pipeline stages over the embedding group and moves the routers' expert
      biases, with the same arithmetic as ``finalize_model_grads``.
    * :func:`with_pipeline_group` adds the gloo pipeline group the engine's P2P needs to Megatron-Core's groups
      (``mcore_ep_groups`` has none: Megatron-Core's driver sends between stages itself).
"""

import dataclasses

import torch
from megatron.core import parallel_state

from ep_overlap_lab.collectives import all_reduce
from ep_overlap_lab.step_loss import StepHooks, StepLoss, StepScales, backward_scales
from megatron.bridge.training.ep_overlap.mcore.base import McoreChunk, gloo_group_like
from megatron.bridge.training.ep_overlap.mcore.graphs import replays
from megatron.bridge.training.ep_overlap.mcore.vision_language import McoreVisionLanguageChunk
from megatron.bridge.utils.process_groups import EPGroups

_UNDER_THE_DRIVER = "fix: run under Megatron-Core's driver (use_ep_overlap_schedule)"


def step_hooks(chunk) -> StepHooks:
    """The hooks the engine calls on ``chunk`` (see the module docstring)."""
    if isinstance(chunk, StepHooks):
        return chunk
    if isinstance(chunk, McoreChunk):
        return McoreStepHooks(chunk)
    return StepHooks()


def with_pipeline_group(groups: EPGroups) -> EPGroups:
    """``groups`` with a gloo group over this rank's pipeline (the P2P matches by tag) where PP > 1 and it has none.
    A collective over the world: every rank calls it."""
    if groups.pp_size == 1 or groups.pp_group is not None:
        return groups
    group, ranks = gloo_group_like(parallel_state.get_pipeline_model_parallel_group(), groups.timeout)
    return dataclasses.replace(groups, pp_group=group, pp_ranks=ranks)


def layout_problems() -> list[str]:
    """What only Megatron-Core's driver and DDP do for this layout: the engine's gradient sync and loss count cover
    data and expert parallelism, not tensor, expert-tensor or context parallelism."""
    problems = []
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp > 1:
        problems.append(
            f"tensor parallelism ({tp} ranks): the engine would count each token's loss on every tensor-parallel "
            "rank and leave the sequence-parallel norms' and the routers' gradients unreduced across them; "
            f"{_UNDER_THE_DRIVER}, which runs it bitwise"
        )
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    if etp > 1:
        problems.append(
            f"expert tensor parallelism ({etp} ranks): the engine's gradient sync takes every expert weight as whole "
            f"on its rank and sums it over the expert-data-parallel ranks it derives without that split; "
            f"{_UNDER_THE_DRIVER}, which runs it bitwise"
        )
    cp = parallel_state.get_context_parallel_world_size()
    if cp > 1:
        problems.append(
            f"context parallelism ({cp} ranks): the engine's microbatches are whole sequences and it does not "
            "slice them across the context-parallel ranks; fix: set context_parallel_size=1, or run under "
            "Megatron-Core's driver (use_ep_overlap_schedule)"
        )
    return problems


def step_problems(model: torch.nn.Module, config) -> list[str]:
    """What Megatron-Core's driver does for a step that the engine does not: replay Transformer Engine CUDA graphs
    (``graphs.py``), scale the loss (``grad_scale_func``), autocast, DSA's indexer loss scale, start paged stash's
    step (``paged_stash_reset``), make and reset the activation offload manager's chunk handlers."""
    problems = []
    graphed = [m.layer_number for m in model.modules() if hasattr(m, "cuda_graphs") and replays(m)]
    if graphed:
        problems.append(
            f"layers {graphed} replay Transformer Engine CUDA graphs, which the engine does not number by "
            f"microbatch; {_UNDER_THE_DRIVER}, or set cuda_graph_impl='none'"
        )
    for name in ("grad_scale_func", "moe_grad_scale_func", "mtp_grad_scale_func"):
        scale = getattr(config, name, None)
        if scale is not None and float(scale(torch.ones(1)) if name == "grad_scale_func" else scale()) != 1.0:
            problems.append(
                f"{name} scales the loss (fp16 loss scaling), and the engine sets its loss scales itself; "
                f"{_UNDER_THE_DRIVER}, or train in bf16 or fp32"
            )
    if config.experimental_attention_variant == "dsa" or config.experimental_attention_variant_loss_scale_func:
        problems.append(
            "experimental_attention_variant: Megatron-Core's driver scales the DSA indexer's loss per "
            f"microbatch, the engine does not; {_UNDER_THE_DRIVER}"
        )
    if getattr(config, "enable_autocast", False):
        problems.append(
            "enable_autocast: Megatron-Core's driver runs the step under torch.autocast, the engine does not; "
            f"{_UNDER_THE_DRIVER}, or set enable_autocast=False"
        )
    if getattr(config, "moe_paged_stash", False):
        problems.append(
            "moe_paged_stash: Megatron-Core's driver starts each step's paged stash (paged_stash_reset: its "
            f"profiling, buffers and page lists), the engine does not; {_UNDER_THE_DRIVER}, or set "
            "moe_paged_stash=False"
        )
    if getattr(config, "fine_grained_activation_offloading", False):
        problems.append(
            "fine_grained_activation_offloading: Megatron-Core's offload manager takes a chunk handler per "
            "microbatch, made where its forward starts (the plan makes it when Megatron-Core's driver builds it) "
            f"and reset after each step by that driver; the engine does neither; {_UNDER_THE_DRIVER}, or set "
            "fine_grained_activation_offloading=False"
        )
    return problems


class McoreStepHooks(StepHooks):
    """The engine's hooks on a Megatron-Core plan (``McoreChunk``)."""

    def __init__(self, chunk: McoreChunk):
        self.chunk = chunk
        self._scales = StepScales()  # the auxiliary-loss scales of an engine step, until finish_step

    def engine_problems(self) -> list[str]:
        problems = []
        if isinstance(self.chunk, McoreVisionLanguageChunk):
            problems.append(
                "Megatron-Bridge's Qwen3VLModel: the EP-overlap engine takes (tokens, labels) microbatches and no "
                f"images; {_UNDER_THE_DRIVER}"
            )
        return problems + layout_problems()

    def start_step(self, loss: StepLoss) -> None:
        """Drops what a failed step held (``McoreChunk.start_step``), refuses :func:`step_problems`, then does what
        Megatron-Core's driver does for a step's first microbatch (low-precision modules cast their weights afresh)
        and sets the MTP and MoE auxiliary-loss scales as its ``forward_step`` sets them and its DDP then averages
        (``step_loss.backward_scales``).

        Raises:
            ValueError: Naming each of :func:`step_problems`.
        """
        chunk = self.chunk
        chunk.start_step()
        problems = step_problems(chunk.model, chunk.config)
        if problems:
            raise ValueError("the EP-overlap engine cannot run this step: " + "; ".join(problems))
        chunk.model.set_is_first_microbatch()
        cp = parallel_state.get_context_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
        mtp, moe = backward_scales(loss, per_token=chunk.config.calculate_per_token_loss, context_parallel=cp)
        self._scales.set(mtp, moe, next(chunk.model.parameters()).device)

    def finish_step(self) -> None:
        self._scales.restore()

    def pipeline_copies(self) -> list[torch.nn.Parameter]:
        """The weights this chunk holds a copy of on another pipeline stage: the word embedding of the first and the
        last stage, when the output layer shares it or an MTP layer reads it (Megatron-Core's
        ``_get_shared_word_embedding_weight``). Empty at PP = 1 and on middle stages."""
        chunk = self.chunk
        whole = chunk.pre_process and chunk.post_process
        shares = chunk.model.share_embeddings_and_output_weights or bool(chunk.config.mtp_num_layers)
        if whole or not shares or not (chunk.pre_process or chunk.post_process):
            return []
        weight = chunk.model.shared_embedding_or_output_weight()
        return [] if weight is None else [weight]

    def sync_pipeline_copies(self, groups: EPGroups) -> None:
        """Sums the gradients of :meth:`pipeline_copies` over Megatron-Core's embedding group (the first and the last
        pipeline stage), as its ``finalize_model_grads`` does, so the copies stay equal after the optimizer step."""
        for weight in self.pipeline_copies():
            group = parallel_state.get_embedding_group()
            main = getattr(weight, "main_grad", None)
            grad = main if main is not None else weight.grad
            if grad is None:
                grad = weight.grad = torch.zeros_like(weight)
            all_reduce(grad, group, op="embedding gradient all-reduce (pipeline copies)", timeout=groups.timeout)

    @torch.no_grad()
    def update_router_biases(self, groups: EPGroups) -> None:
        """What Megatron-Core's ``finalize_model_grads`` does for the routers after a step's gradient sync: with
        ``moe_router_enable_expert_bias``, each training router's bias moves toward balance from the step's token
        counts summed over the tensor x data x context-parallel group, then the counts restart (the arithmetic of
        its ``get_updated_expert_bias``, under the engine's collective timeout); with a global auxiliary loss, its
        token trackers restart (``reset_model_temporary_tensors``), or the next step's loss would count this one's."""
        model, config = self.chunk.model, self.chunk.config
        if "global_aux_loss" in str(config.moe_router_load_balancing_type):
            for module in model.modules():
                if hasattr(module, "reset_global_aux_loss_tracker"):
                    module.reset_global_aux_loss_tracker()
        routers = [
            module
            for module in model.modules()
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
        updated_LE = torch.stack([router.expert_bias for router in routers])
        updated_LE += torch.sign(offset_LE) * config.moe_router_bias_update_rate
        for router, updated_E in zip(routers, updated_LE):
            router.expert_bias.copy_(updated_E)
            router.local_tokens_per_expert.zero_()
