"""This project's layer schedule inside Megatron-Core's combined 1F1B driver, installed by a Megatron-Bridge hook.

Contract:
    * With ``overlap_moe_expert_parallel_comm`` on, Megatron-Core's schedules (``combined_1f1b``, with or without
      interleaved pipelining) ask the recipe's ``forward_step`` for one schedule plan per microbatch and model
      chunk, and Megatron-Bridge's stock ``forward_step`` builds it with
      ``model.build_schedule_plan(tokens, position_ids, attention_mask, labels=..., loss_mask=...)``.
    * :func:`use_ep_overlap_schedule` is a Bridge pre-wrap hook (``cfg.model.register_pre_wrap_hook``). It gives
      each ``GPTModel`` or ``HybridModel`` (a whole model, or each pipeline chunk) its own ``build_schedule_plan``
      (an instance attribute; the class is untouched; Megatron-Core's driver looks the method up by name), which
      returns an :class:`EPOverlapSchedulePlan`. No upstream file changes.
    * Megatron-Core runs each step of its driver as ``EPOverlapSchedulePlan.run(f_plan, b_plan, b_grad=...)``:
      a forward alone, a backward alone, or the forward of one microbatch paired with the backward of another.
      ``run`` executes the schedule program's step of that kind (``program.windows_of``: the paired layer step per
      unit) with the engine's executor, as the engine does. It returns what the chunk's model ``forward``
      returns: per-token losses on the last chunk, which Megatron-Core reduces with the recipe's loss function,
      else the hidden states. ``b_grad`` is the gradient of that output.
    * With pipelining, Megatron-Core passes its P2P hooks; ``run`` calls ``pre_forward`` and ``pre_backward``
      (wait for the received activation / gradient) where the first op that reads it runs, so the other half's ops
      go on while it is in flight, and ``post_forward`` (send the activation) and then ``post_backward`` (send the
      input gradient) after the layers, before the deferred attention wgrad and the head. A chunk's input is the
      tensor Megatron-Core set with ``set_input_tensor``; its gradient lands in that tensor's ``.grad``, where
      Megatron-Core reads it.
    * Losses and gradients are bitwise equal to Megatron-Core's plain forward/backward (tests: PP = 1, PP 2 x VPP 2
      through its interleaved schedule, and the plain 1F1B pipeline through ``get_forward_backward_func``).
    * Everything is checked when the hook runs, before the first step: the EP-overlap rules with the hook's
      options (one :class:`CommOverlapConfigError`, the same lines the engine and the harness print) and the
      adapter's limits (``chunk_for``).
    * With ``moe_paged_stash``, each built plan calls the model's ``preprocess_for_paged_stash``, as Megatron-Core's
      own plan does; its driver starts each step's stash.
    * All chunks of a rank share one lane, so every all-to-all of the rank goes through one comm stream and
      every rank of an EP group issues them in the same order. A new step (a plan built while none is in
      flight) starts a new :class:`StepRecorder`; ``build_schedule_plan.recorder`` is the current or last step's.
"""

import logging
from datetime import timedelta

import torch
from megatron.core.pipeline_parallel.utils import AbstractSchedulePlan

from megatron.bridge.training.ep_overlap.mcore.agreement import Agreement
from megatron.bridge.training.ep_overlap.mcore.base import McoreChunk, MicrobatchView, gloo_group_like, mcore_ep_groups
from megatron.bridge.training.ep_overlap.mcore.factory import chunk_for
from megatron.bridge.training.ep_overlap.mcore.forward_backward import unpaired_loop_problem
from megatron.bridge.training.ep_overlap.mcore.packed_guard import (
    DROPPED,
    NOT_GIVEN,
    dropped_packed_sequence,
    packed_problems,
)
from megatron.bridge.training.ep_overlap.options import WGRAD_WINDOWS, EPOverlapOptions
from megatron.bridge.training.ep_overlap.program.interpreter import run_ops
from megatron.bridge.training.ep_overlap.program.pipeline import BACKWARD, FORWARD, Phase
from megatron.bridge.training.ep_overlap.program.steps import ChunkShape, StepKind, step_kind, windows_of
from megatron.bridge.training.ep_overlap.runtime.inputs import UnitInput
from megatron.bridge.training.ep_overlap.runtime.lanes import Pending, done, make_lane
from megatron.bridge.training.ep_overlap.runtime.nodes import ChunkIO, MicrobatchNodes
from megatron.bridge.training.ep_overlap.runtime.records import StepRecorder
from megatron.bridge.training.ep_overlap.settings import Settings, apply_deferred, resolve
from megatron.bridge.training.moe_overlap_rules import use_bridge_schedule
from megatron.bridge.utils.logging import warn_rank0
from megatron.bridge.utils.process_groups import refuse_together

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = timedelta(minutes=10)  # NCCL's default collective timeout
# What Megatron-Core's driver asks of one call, and the phase its records carry.
_PHASES = {StepKind.PAIRED: Phase.PAIRED, StepKind.FORWARD: Phase.WARMUP, StepKind.BACKWARD: Phase.COOLDOWN}


class _HostEvent:
    """Host tensors need no event: work runs in issue order. Stands in for the CUDA event Megatron-Core waits on."""

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


# A forward argument the plan does not take: why, and the fix (others: not scheduled by the plan; pass None).
_UNSCHEDULED = {
    "decoder_input": (
        "the plan embeds input_ids on the first chunk and receives the activation on the others",
        "pass decoder_input=None",
    ),
    "padding_mask": (
        "padded tokens would still be routed and counted in the routers' load statistics (the plan does not "
        "take the mask Megatron-Bridge main passes to leave them out)",
        "pass padding_mask=None (pad with tokens whose labels are masked), or turn overlap_moe_expert_parallel_comm "
        "off for this model",
    ),
}


class _MicrobatchModel(MicrobatchView):
    """One microbatch's view of a plan under Megatron-Core's driver: also its loss mask, and a head that returns
    per-token losses (the recipe's loss function reduces them)."""

    def __init__(
        self, chunk: McoreChunk, microbatch: int, position_ids, attention_mask, loss_mask=None, packed_seq_params=None
    ):
        super().__init__(chunk, position_ids, attention_mask, packed_seq_params, microbatch)
        self.loss_mask = loss_mask

    def head_loss(
        self, x_SBH: torch.Tensor, labels_BS: torch.Tensor, normalizer: None, tokens_BS: torch.Tensor | None
    ) -> torch.Tensor:
        """Per-token losses, as the model's ``forward`` returns them; the recipe's loss function reduces them."""
        return self.chunk.per_token_losses(x_SBH, labels_BS, tokens_BS, self.loss_mask, self)


class _RankSession:
    """What a rank's chunks share: the lane of the current step, the plans in flight, and the agreement of the EP
    ranks on each step's microbatch count (``agreement.py``)."""

    def __init__(self, groups, high_priority: bool, agreement: Agreement | None = None):
        self.groups, self.high_priority = groups, high_priority
        self.agreement = agreement or Agreement()
        self.lane = None
        self.step = 0
        self.in_flight: set[tuple[int, int]] = set()  # (builder, microbatch)

    def lane_for(self, device: torch.device):
        if not self.in_flight:  # a new step: its count agreed before any of its all-to-alls
            self.agreement.start_step()
            self.lane = make_lane(self.groups, device, high_priority=self.high_priority)
            self.step += 1
        return self.lane


class EPOverlapSchedulePlan(AbstractSchedulePlan):
    """One microbatch of one model chunk, as Megatron-Core's combined 1F1B driver schedules it."""

    def __init__(self, builder: "EPOverlapPlanBuilder", nodes: MicrobatchNodes, event, input_tensor):
        self.builder, self.nodes, self.event = builder, nodes, event
        self.vp_stage = builder.chunk.model.vp_stage
        self.input_tensor = input_tensor  # what Megatron-Core set as this chunk's input (None on the first chunk)

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
            The forward's output (per-token losses on the last chunk, else hidden states), or None.
        """
        call = _DriverCall(f_schedule_plan, b_schedule_plan, (pre_forward, pre_backward, post_forward, post_backward))
        f, b = call.bind_forward(), call.bind_backward(b_grad)
        kind = step_kind(f is not None, b is not None)
        either = f_schedule_plan or b_schedule_plan
        session = either.builder.session
        session.agreement.check_call(
            str(kind), either.vp_stage, f.mb if f is not None else None, b.mb if b is not None else None
        )
        session.lane.recorder.phase = _PHASES[kind]
        windows = windows_of(
            kind,
            [0] if f is not None else [],
            [1] if b is not None else [],
            f_schedule_plan.builder.shape if f is not None else None,
            b_schedule_plan.builder.shape if b is not None else None,
            delay_wgrad=either.builder.settings.delay_wgrad,
            window=either.builder.settings.attention_wgrad_window,
        )
        run_ops([op for window in windows for op in window.ops], {0: f, 1: b})
        call.post_what_is_left()
        if b is not None:
            session.in_flight.discard((id(b_schedule_plan.builder), b.mb))
        if f is None:
            return None
        return f.loss if f_schedule_plan.builder.chunk.post_process else call.output


class _DriverCall:
    """One ``run`` call's P2P hooks and chunk I/O: Megatron-Core's hooks run once per forward and per backward,
    activation first (they also post the receives of later steps); the first and last chunks send nothing (None),
    as in Megatron-Core's plan."""

    def __init__(self, f_plan, b_plan, hooks: tuple):
        self.f_plan, self.b_plan = f_plan, b_plan
        self.pre_forward, self.pre_backward, self.post_forward_hook, self.post_backward_hook = hooks
        self.posted: set = set()
        self.output = None

    def post_forward(self, x: torch.Tensor | None) -> None:
        self.posted.add(FORWARD)
        if self.post_forward_hook is not None:
            self.post_forward_hook(x, self.f_plan.vp_stage)

    def post_backward(self, grad: torch.Tensor | None) -> None:
        if self.f_plan is not None and FORWARD not in self.posted:
            self.post_forward(None)
        self.posted.add(BACKWARD)
        if self.post_backward_hook is not None:
            self.post_backward_hook(grad, self.b_plan.vp_stage)

    def bind_forward(self) -> MicrobatchNodes | None:
        """The forward's nodes, reading the received activation and sending their output through the hook. The
        wait for a received activation is the first forward op's, so a backward's ops run while it is in flight."""
        if self.f_plan is None:
            return None
        f = self.f_plan.nodes
        if self.pre_forward is None:
            f.io.input = done(self.f_plan.input_tensor)
        elif self.f_plan.builder.chunk.pre_process:
            self.pre_forward(self.f_plan.vp_stage)  # receives nothing; frees what the last step sent
            f.io.input = done(self.f_plan.input_tensor)
        else:  # the received activation is complete once the hook returns
            f.io.input = Pending(self.f_plan.input_tensor, lambda: self.pre_forward(self.f_plan.vp_stage))

        def send_output(x: torch.Tensor) -> None:
            self.output = x.detach()  # Megatron-Core may free what it gets back; the nodes keep their own
            self.post_forward(self.output)

        f.io.send_output = send_output
        return f

    def bind_backward(self, b_grad: torch.Tensor | None) -> MicrobatchNodes | None:
        """The backward's nodes, given the output's gradient, sending the input's where Megatron-Core reads it. The
        wait for a received gradient is the first backward op's, so a forward's ops run while it is in flight."""
        if self.b_plan is None:
            return None
        b = self.b_plan.nodes
        if self.b_plan.builder.chunk.post_process:  # the loss's gradient: nothing received
            if self.pre_backward is not None:
                self.pre_backward(self.b_plan.vp_stage)
            b.output_grad = b_grad
        elif self.pre_backward is None:
            b.io.grad = done(b_grad)
        else:  # the received gradient is complete once the hook returns
            b.io.grad = Pending(b_grad, lambda: self.pre_backward(self.b_plan.vp_stage))

        def send_grad(grad: torch.Tensor) -> None:
            self.b_plan.input_tensor.grad = grad  # where Megatron-Core reads the input gradient
            self.post_backward(grad)

        b.io.send_grad = send_grad
        return b

    def post_what_is_left(self) -> None:
        """The hooks of a chunk that sent nothing (the first's backward, the last's forward) run with None."""
        if self.f_plan is not None and FORWARD not in self.posted:
            self.post_forward(None)
        if self.b_plan is not None and BACKWARD not in self.posted:
            self.post_backward(None)


def checked_chunk(
    model: torch.nn.Module, attention_wgrad_window: int | None, high_priority: bool
) -> tuple[Settings, McoreChunk]:
    """The settings and the plan the hook runs ``model`` with, after every check (no collective).

    Raises:
        CommOverlapConfigError: When the model config breaks an EP-overlap rule (a window other than 1, 2 or None
            among them).
        ValueError: When the plan does not schedule the model (``chunk_for``), or the window is left to the planner
            (None with delayed wgrad).
    """
    config = model.config
    options = EPOverlapOptions(
        delay_wgrad=bool(config.delay_wgrad_compute),
        attention_wgrad_window=attention_wgrad_window,
        high_priority_comm=high_priority,
    )
    use_bridge_schedule(config)  # the plan will run on this project's schedule: its rules, checked first
    settings = resolve(config, options).checked()
    if settings.wgrad_window_auto:  # the planner measures a plain step first, which this driver never runs
        raise ValueError(
            f"attention_wgrad_window=None (auto): Megatron-Core's driver runs every step overlapped, so the hook "
            f"cannot let the planner choose; give one of {WGRAD_WINDOWS}"
        )
    chunk = chunk_for(model, delay_wgrad=settings.delay_wgrad)
    if not config.overlap_moe_expert_parallel_comm:
        warn_rank0(
            logger,
            "use_ep_overlap_schedule: overlap_moe_expert_parallel_comm is off, so Megatron-Core never asks for a "
            "schedule plan and this hook changes nothing. Set comm_overlap.overlap_moe_expert_parallel_comm=True.",
        )
    return settings, chunk


class EPOverlapPlanBuilder:
    """``build_schedule_plan`` for one GPTModel or HybridModel, or one pipeline chunk (see the module docstring).

    Args:
        model: A Megatron-Core ``GPTModel`` or ``HybridModel``: the whole model, or one pipeline chunk of it.
        session: What this rank's chunks share (one per rank; :func:`use_ep_overlap_schedule` makes it).
        attention_wgrad_window: With delayed wgrad, the layer-step window of the attention wgrad (1 or 2; None, the
            planner's choice, is refused: see :func:`checked_chunk`).
        checked: What :func:`checked_chunk` returned for ``model`` (the hook checks every chunk first).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        session: _RankSession,
        *,
        attention_wgrad_window: int | None = 1,
        checked: tuple[Settings, McoreChunk] | None = None,
    ):
        self.settings, self.chunk = checked or checked_chunk(model, attention_wgrad_window, session.high_priority)
        self.session = session
        self.shape = ChunkShape.of(self.chunk)
        self._step, self._next_microbatch = 0, 0

    @property
    def recorder(self) -> StepRecorder | None:
        """What the current (or last) step recorded on this rank: every all-to-all and compute node, by phase."""
        return None if self.session.lane is None else self.session.lane.recorder

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        decoder_input: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        packed_seq_params=NOT_GIVEN,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        **unsupported,
    ) -> EPOverlapSchedulePlan:
        """Binds one microbatch to the chunk; runs nothing (``run`` does). Same arguments as the model's forward (a
        vision-language model's images and videos with their grids too, bound where the plan takes them).
        ``packed_seq_params`` not passed at all (as Megatron-Bridge 0.6.2's forward steps call this) is None, once
        ``packed_guard.dropped_packed_sequence`` has looked whether a packed microbatch's parameters were dropped."""
        multimodal = dict(pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                          pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid_thw)  # fmt: skip
        inputs = {k: v for k, v in multimodal.items() if v is not None and k in self.chunk.bound_inputs}
        given = sorted(k for k, v in (unsupported | multimodal).items() if v is not None and k not in inputs)
        if decoder_input is not None:
            given.insert(0, "decoder_input")
        missing = []
        if dropped_packed_sequence(packed_seq_params, position_ids, attention_mask):
            missing.append(DROPPED)
        if packed_seq_params is NOT_GIVEN:
            packed_seq_params = None
        elif packed_seq_params is not None:
            missing += packed_problems(self.chunk, packed_seq_params, input_ids)
        if self.chunk.pre_process and input_ids is None:
            missing.append("input_ids are required on the first chunk")
        if self.chunk.post_process and labels is None:
            missing.append("labels are required on the last chunk (its output is per-token losses)")
        if self.chunk.mtp and input_ids is None:
            missing.append("input_ids are required on the chunk with the multi-token prediction layer")
        missing += self.chunk.input_problems(input_ids, inputs, packed_seq_params)
        if missing or given:
            problems = missing + [
                "{}: {}; fix: {}".format(name, *_UNSCHEDULED.get(name, ("not scheduled by the plan", "pass None")))
                for name in given
            ]
            raise ValueError("EP-overlap build_schedule_plan: " + "; ".join(problems))
        if getattr(self.chunk.config, "moe_paged_stash", False):
            # Where Megatron-Core's build_schedule_plan calls it: this microbatch's expert groups are numbered from
            # here, so the stash pushes and pops the paired microbatches' pages in the order it recorded.
            self.chunk.model.preprocess_for_paged_stash()
        session = self.session
        device = next(self.chunk.parameters()).device
        lane = session.lane_for(device)
        if self._step != session.step:  # this chunk's first microbatch of the step
            self._step, self._next_microbatch = session.step, 0
            self.chunk.start_step()
        index = self._next_microbatch
        session.agreement.check_plan(index)
        self._next_microbatch += 1
        session.in_flight.add((id(self), index))
        view = _MicrobatchModel(self.chunk, index, position_ids, attention_mask, loss_mask, packed_seq_params)
        view = self.chunk.bind_inputs(view, input_ids, inputs)
        nodes = MicrobatchNodes(UnitInput(view, index, input_ids, labels, None), lane, ChunkIO())
        event = torch.cuda.Event() if device.type == "cuda" else _HostEvent()
        input_tensor = None if self.chunk.pre_process else self.chunk.model.decoder.input_tensor
        return EPOverlapSchedulePlan(self, nodes, event, input_tensor)


def use_ep_overlap_schedule(
    models: list[torch.nn.Module],
    *,
    timeout: timedelta = DEFAULT_TIMEOUT,
    attention_wgrad_window: int | None = 1,
    full_recompute: tuple[str, int] | None = None,
) -> list[torch.nn.Module]:
    """Megatron-Bridge pre-wrap hook: Megatron-Core's combined 1F1B then runs this project's layer schedule.

    Use it as ``cfg.model.register_pre_wrap_hook(use_ep_overlap_schedule)`` (``functools.partial`` sets the
    keywords). ``models`` are this rank's chunks (one without pipelining). Returns them unchanged but for their
    ``build_schedule_plan``. ``attention_wgrad_window``: with delayed wgrad, the window of the attention wgrad, 1
    or 2 (None, the planner's choice, needs a plain step first, which Megatron-Core's driver never runs: refused;
    without delayed wgrad there is nothing to place). ``full_recompute=(method, layers)`` sets
    ``recompute_granularity="full"``, ``recompute_method`` and ``recompute_num_layers`` on the built config first:
    Megatron-Core's config refuses them with the overlap flag when Bridge builds it from the recipe. So it does the
    overlap and delayed-wgrad flags in the plain 1F1B pipeline (PP > 1 without virtual stages), which the recipe's
    ``CommOverlapConfig.setup`` kept off the config, unless the patched ``setup`` set them before the build; there
    Megatron-Bridge's ``train()`` must take :func:`get_forward_backward_func` of this package (the patch makes it),
    else the hook refuses, naming the fix.

    Raises:
        CommOverlapConfigError: When the model config breaks an EP-overlap rule.
        ValueError: When the model is outside what the plan supports (another model class, more than one MTP layer,
            fused residual norms, selective recompute of ``moe`` or ``layernorm``, NCCL EP's zero-copy
            buffers, multimodal rotary positions outside Megatron-Bridge's ``Qwen3VLModel``; the list with what is
            supported, MTP, tied embeddings, full recompute, the flex dispatcher, packed sequences and Bridge's
            Qwen3-VL and Qwen3.5-VL models among them:
            ``docs/training/megatron-core-integration.md``), or another rank refused it. Every rank raises, before
            any collective of the step.
    """
    config = models[0].config  # the chunks share it
    if full_recompute is not None:
        config.recompute_granularity = "full"
        config.recompute_method, config.recompute_num_layers = full_recompute
    apply_deferred(config, built=True)  # the plain 1F1B pipeline's flags, if Bridge's setup did not set them
    high_priority = bool(getattr(config, "high_priority_a2a_comm_stream", False))
    checked, refusal = [], None
    try:
        checked = [checked_chunk(model, attention_wgrad_window, high_priority) for model in models]
        loop = unpaired_loop_problem(config)
        if loop:
            raise ValueError(loop)
    except ValueError as error:  # a CommOverlapConfigError is one
        refusal = error
    # A pipeline stage may refuse what another accepts (a chunk's MTP layer): all refuse together, or one would
    # wait for a peer that is gone.
    refuse_together(refusal)
    groups = mcore_ep_groups(timeout)
    agreement = Agreement()
    if torch.distributed.is_initialized() and groups.ep_size > 1:
        agreement = Agreement(gloo_group_like(groups.ep_group, timeout)[0])
    session = _RankSession(groups, high_priority, agreement)
    for model, (settings, plan) in zip(models, checked):
        model.build_schedule_plan = EPOverlapPlanBuilder(model, session, checked=(settings, plan))
    return models


use_ep_overlap_schedule.runs_bridge_schedule = True  # registered as a pre-wrap hook, it marks the config's schedule
