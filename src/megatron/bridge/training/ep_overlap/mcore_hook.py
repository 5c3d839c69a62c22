"""This project's layer schedule inside Megatron-Core's combined 1F1B driver, installed by a Megatron-Bridge hook.

Contract:
    * With ``overlap_moe_expert_parallel_comm`` on, Megatron-Core's schedule (``combined_1f1b``) asks the recipe's
      ``forward_step`` for one schedule plan per microbatch, and Megatron-Bridge's stock ``forward_step`` builds it
      with ``model.build_schedule_plan(tokens, position_ids, attention_mask, labels=..., loss_mask=...)``.
    * :func:`use_ep_overlap_schedule` is a Bridge pre-wrap hook (``cfg.model.register_pre_wrap_hook``). It gives
      each ``GPTModel`` its own ``build_schedule_plan`` (an instance attribute; the class is untouched), which
      returns an :class:`EPOverlapSchedulePlan`. No upstream file changes.
    * Megatron-Core runs each step of its driver as ``EPOverlapSchedulePlan.run(f_plan, b_plan, b_grad=...)``: the
      first microbatch's forward alone, then forward of microbatch i+1 paired with backward of microbatch i
      through :func:`~megatron.bridge.training.ep_overlap.schedule.paired_microbatch_step` (``layer_step`` per
      layer), then the last backward alone. ``run`` returns what ``GPTModel.forward`` returns (per-token losses);
      Megatron-Core applies the recipe's loss function to it and hands the gradient of that output back as
      ``b_grad``. Losses and gradients are bitwise equal to Megatron-Core's plain forward/backward (tests).
    * Everything is checked when the hook runs, before the first step: the EP-overlap rules (one
      :class:`CommOverlapConfigError`) and the adapter's limits (:class:`McoreGPTPlan`). Pipeline parallelism is
      refused there: this plan runs whole models (PP = 1).
    * All-to-alls go through one lane per model, so the two microbatches of a paired step share one comm stream
      and every rank issues them in the same order. A new step (a plan built while none is in flight) starts a
      new :class:`StepRecorder`; ``build_schedule_plan.recorder`` is the current or last step's.
"""

import logging
from datetime import timedelta

import torch
from megatron.core.pipeline_parallel.utils import AbstractSchedulePlan

from megatron.bridge.training.ep_overlap.lanes import make_lane
from megatron.bridge.training.ep_overlap.mcore import McoreGPTPlan, mcore_ep_groups
from megatron.bridge.training.ep_overlap.nodes import MicrobatchNodes
from megatron.bridge.training.ep_overlap.records import StepRecorder
from megatron.bridge.training.ep_overlap.schedule import WGRAD_WINDOWS, paired_microbatch_step
from megatron.bridge.training.moe_overlap_rules import CommOverlapConfigError, check_moe_overlap
from megatron.bridge.utils.logging import warn_rank0

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = timedelta(minutes=10)  # NCCL's default collective timeout


class _HostEvent:
    """Host tensors need no event: work runs in issue order. Stands in for the CUDA event Megatron-Core waits on."""

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


class _MicrobatchModel:
    """One microbatch's view of a :class:`McoreGPTPlan`: its position ids, attention mask and rotary embedding."""

    def __init__(self, plan: McoreGPTPlan, position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None):
        self.plan, self.position_ids, self.attention_mask = plan, position_ids, attention_mask
        self.rotary_pos_emb = None
        self.layers = [layer.bound_to(self) for layer in plan.layers]

    def embed(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        x_SBH = self.plan.embed(tokens_BS, self.position_ids)
        self.rotary_pos_emb = self.plan.rotary_pos_emb
        return x_SBH

    def head_loss(self, x_SBH: torch.Tensor, labels_BS: torch.Tensor, normalizer: None) -> torch.Tensor:
        """Per-token losses, as ``GPTModel.forward`` returns them; the recipe's loss function reduces them."""
        return self.plan.per_token_losses(x_SBH, labels_BS)


class EPOverlapSchedulePlan(AbstractSchedulePlan):
    """One microbatch of one model, as Megatron-Core's combined 1F1B driver schedules it."""

    def __init__(self, builder: "EPOverlapPlanBuilder", nodes: MicrobatchNodes, event):
        self.builder, self.nodes, self.event = builder, nodes, event

    @staticmethod
    def run(
        f_schedule_plan: "EPOverlapSchedulePlan | None",
        b_schedule_plan: "EPOverlapSchedulePlan | None",
        b_grad: torch.Tensor | None = None,
        pre_forward=None,
        pre_backward=None,
        post_forward=None,
        post_backward=None,
    ) -> torch.Tensor | None:
        """Forward of ``f_schedule_plan`` paired with backward of ``b_schedule_plan`` (either may be None).

        Returns:
            The forward's per-token losses, or None without a forward.
        """
        if any(hook is not None for hook in (pre_forward, pre_backward, post_forward, post_backward)):
            raise NotImplementedError("the EP-overlap plan runs PP = 1 only; it has no pipeline P2P hooks")
        f = f_schedule_plan.nodes if f_schedule_plan is not None else None
        b = b_schedule_plan.nodes if b_schedule_plan is not None else None
        builder = (f_schedule_plan or b_schedule_plan).builder
        if b is not None:
            b.output_grad = b_grad
        if f is not None and b is not None:
            builder.lane.recorder.phase = "paired"
            paired_microbatch_step(f, b, builder.attention_wgrad_window)
        elif f is not None:
            builder.lane.recorder.phase = "warmup"
            f.forward()
        else:
            builder.lane.recorder.phase = "cooldown"
            b.backward()
        if b is not None:
            builder.finished(b_schedule_plan)
        return f.loss if f is not None else None


class EPOverlapPlanBuilder:
    """``build_schedule_plan`` for one GPTModel (see the module docstring).

    Args:
        model: A Megatron-Core ``GPTModel`` (whole model: first and last pipeline stage).
        timeout: How long any all-to-all may take before the rank raises instead of waiting on.
        attention_wgrad_window: With delayed wgrad, the layer-step window of the attention wgrad (1 or 2).
    """

    def __init__(self, model: torch.nn.Module, *, timeout: timedelta, attention_wgrad_window: int = 1):
        if attention_wgrad_window not in WGRAD_WINDOWS:
            raise ValueError(f"attention_wgrad_window must be one of {WGRAD_WINDOWS}, got {attention_wgrad_window!r}")
        if not (model.pre_process and model.post_process):
            raise ValueError(
                "the EP-overlap plan runs whole models: pipeline_model_parallel_size must be 1 (this chunk has "
                f"pre_process={model.pre_process}, post_process={model.post_process})"
            )
        config = model.config
        self.delay_wgrad = bool(config.delay_wgrad_compute)
        self.plan = McoreGPTPlan(model, delay_wgrad=self.delay_wgrad)
        violations = check_moe_overlap(
            config, overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=self.delay_wgrad
        )
        if violations:
            raise CommOverlapConfigError(violations)
        if not config.overlap_moe_expert_parallel_comm:
            warn_rank0(
                logger,
                "use_ep_overlap_schedule: overlap_moe_expert_parallel_comm is off, so Megatron-Core never asks for a "
                "schedule plan and this hook changes nothing. Set comm_overlap.overlap_moe_expert_parallel_comm=True.",
            )
        self.groups = mcore_ep_groups(timeout)
        self.high_priority = bool(getattr(config, "high_priority_a2a_comm_stream", False))
        self.attention_wgrad_window = attention_wgrad_window
        self.lane = None
        self._in_flight: set[int] = set()
        self._next_microbatch = 0

    @property
    def recorder(self) -> StepRecorder | None:
        """What the current (or last) step recorded: every all-to-all and compute node, by phase."""
        return None if self.lane is None else self.lane.recorder

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        decoder_input: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        **unsupported,
    ) -> EPOverlapSchedulePlan:
        """Binds one microbatch to the model; runs nothing (``run`` does). Same arguments as ``GPTModel``'s."""
        given = sorted(name for name, value in unsupported.items() if value is not None)
        if decoder_input is not None:
            given.insert(0, "decoder_input")
        if labels is None or given:
            problems = (["labels are required (the plan's output is per-token losses)"] if labels is None else []) + [
                f"{name} is not supported; pass None" for name in given
            ]
            raise ValueError("EP-overlap build_schedule_plan: " + "; ".join(problems))
        if not self._in_flight:  # a new step
            device = input_ids.device
            self.lane = make_lane(self.groups, device, high_priority=self.high_priority)
            self._next_microbatch = 0
        index = self._next_microbatch
        self._next_microbatch += 1
        self._in_flight.add(index)
        view = _MicrobatchModel(self.plan, position_ids, attention_mask)
        nodes = MicrobatchNodes(view, index, input_ids, labels, None, self.lane, self.delay_wgrad)
        event = torch.cuda.Event() if input_ids.is_cuda else _HostEvent()
        return EPOverlapSchedulePlan(self, nodes, event)

    def finished(self, plan: EPOverlapSchedulePlan) -> None:
        """Its backward ran: the plan leaves the step."""
        self._in_flight.discard(plan.nodes.mb)


def use_ep_overlap_schedule(
    models: list[torch.nn.Module], *, timeout: timedelta = DEFAULT_TIMEOUT, attention_wgrad_window: int = 1
) -> list[torch.nn.Module]:
    """Megatron-Bridge pre-wrap hook: Megatron-Core's combined 1F1B then runs this project's layer schedule.

    Use it as ``cfg.model.register_pre_wrap_hook(use_ep_overlap_schedule)`` (``functools.partial`` sets the
    keywords). Returns ``models`` unchanged but for their ``build_schedule_plan``.

    Raises:
        CommOverlapConfigError: When the model config breaks an EP-overlap rule.
        ValueError: When the model is outside what the plan supports (pipeline stages, tied embeddings, biases,
            a dispatcher other than ``alltoall``).
    """
    for model in models:
        model.build_schedule_plan = EPOverlapPlanBuilder(
            model, timeout=timeout, attention_wgrad_window=attention_wgrad_window
        )
    return models
