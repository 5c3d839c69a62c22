"""Megatron-Bridge pre-wrap hook that makes Megatron-Core's combined 1F1B driver run this project's layer schedule.

Each chunk gets an instance ``build_schedule_plan`` (Megatron-Core's driver looks it up by name); a plan's ``run``
calls Megatron-Core's P2P hooks where its own plan does, and a chunk's input gradient goes to the ``.grad`` of the
tensor set by ``set_input_tensor``. A rank's chunks share one lane (one all-to-all order). Results are bitwise equal.
"""

import logging
from datetime import timedelta
from functools import partial
from types import SimpleNamespace

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.pipeline_parallel.utils import AbstractSchedulePlan

from megatron.bridge.training.ep_overlap.mcore.agreement import Agreement, stops_with_a_peers_reason
from megatron.bridge.training.ep_overlap.mcore.base import McoreChunk, MicrobatchView, gloo_group_like, mcore_ep_groups
from megatron.bridge.training.ep_overlap.mcore.forward_backward import unpaired_loop_problem
from megatron.bridge.training.ep_overlap.mcore.gpt import McoreGPTChunk
from megatron.bridge.training.ep_overlap.mcore.hybrid import McoreHybridChunk
from megatron.bridge.training.ep_overlap.mcore.offloading import start_offloading
from megatron.bridge.training.ep_overlap.mcore.packed_guard import (
    DROPPED,
    NOT_GIVEN,
    PackedGuard,
    packed_problems,
)
from megatron.bridge.training.ep_overlap.mcore.vision_language import McoreVisionLanguageChunk, is_vision_language
from megatron.bridge.training.ep_overlap.options import WGRAD_WINDOWS, EPOverlapOptions
from megatron.bridge.training.ep_overlap.program.interpreter import run_ops
from megatron.bridge.training.ep_overlap.program.pipeline import BACKWARD, FORWARD, Phase
from megatron.bridge.training.ep_overlap.program.steps import ChunkShape, StepKind, step_kind, windows_of
from megatron.bridge.training.ep_overlap.runtime.lanes import Pending, done, make_lane
from megatron.bridge.training.ep_overlap.runtime.nodes import ChunkIO, MicrobatchNodes, UnitInput
from megatron.bridge.training.ep_overlap.runtime.records import StepRecorder
from megatron.bridge.training.ep_overlap.settings import Settings, apply_deferred, resolve
from megatron.bridge.training.moe_overlap_rules import use_bridge_schedule
from megatron.bridge.utils.logging import warn_rank0
from megatron.bridge.utils.process_groups import refuse_together

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = timedelta(minutes=10)  # NCCL's default collective timeout
_PHASES = {StepKind.PAIRED: Phase.PAIRED, StepKind.FORWARD: Phase.WARMUP, StepKind.BACKWARD: Phase.COOLDOWN}


class _HostEvent:
    """The plan's ``event``: Megatron-Core's driver waits on and records it around its loss node, which runs on the
    compute stream that made our output, so there is nothing to order (the lane orders its own streams)."""

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


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
    def __init__(
        self, chunk: McoreChunk, microbatch: int, position_ids, attention_mask, loss_mask=None, packed_seq_params=None
    ):
        super().__init__(chunk, position_ids, attention_mask, packed_seq_params, microbatch)
        self.loss_mask = loss_mask

    def head_loss(
        self, x_SBH: torch.Tensor, labels_BS: torch.Tensor, normalizer: None, tokens_BS: torch.Tensor | None
    ) -> torch.Tensor:
        return self.chunk.per_token_losses(x_SBH, labels_BS, tokens_BS, self.loss_mask, self)


class _RankSession:
    """What a rank's chunks share: the current step's lane, the plans in flight, the EP ranks' :class:`Agreement`."""

    def __init__(self, groups, high_priority: bool, agreement: Agreement):
        self.groups, self.high_priority, self.agreement = groups, high_priority, agreement
        self.lane = None
        self.step = 0
        self.in_flight: set[tuple[int, int]] = set()  # (builder, microbatch)

    def lane_for(self, device: torch.device):
        if not self.in_flight:  # a new step: its count agreed before any of its all-to-alls
            self.agreement.start_step()
            if self.lane is None:  # one lane per rank: Megatron-Core's comm stream, events reused every step
                self.lane = make_lane(self.groups, device, high_priority=self.high_priority, timed=False)
            self.lane.new_step()
            self.step += 1
        return self.lane


class EPOverlapSchedulePlan(AbstractSchedulePlan):
    """One microbatch of one model chunk, as Megatron-Core's combined 1F1B driver schedules it."""

    def __init__(self, builder: "EPOverlapPlanBuilder", nodes: MicrobatchNodes, event, input_tensor):
        self.builder, self.nodes, self.event = builder, nodes, event
        self.vp_stage = builder.chunk.model.vp_stage
        self.input_tensor = input_tensor  # what Megatron-Core set as this chunk's input (None on the first chunk)

    def num_layers(self) -> int:
        """Megatron-FSDP (``optim_grads_params``): Megatron-Core's driver sets each layer's reshard hooks."""
        return len(self.nodes.layers)

    def get_layer(self, i: int) -> SimpleNamespace:
        layer, delayed = self.nodes.layers[i], self.builder.settings.delay_wgrad
        return SimpleNamespace(set_fsdp_reshard_hooks=partial(layer.set_fsdp_reshard_hooks, after_wgrad=delayed))

    @staticmethod
    @stops_with_a_peers_reason  # a count mismatch a peer posted, not the collective it left
    def run(
        f_schedule_plan: "EPOverlapSchedulePlan | None",
        b_schedule_plan: "EPOverlapSchedulePlan | None",
        b_grad: torch.Tensor | None = None,
        pre_forward=None,
        pre_backward=None,
        post_forward=None,
        post_backward=None,
    ) -> torch.Tensor | None:
        """Forward of ``f_schedule_plan`` paired with backward of ``b_schedule_plan`` (either may be None)."""
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
        call.unbind()
        if b is not None:
            session.in_flight.discard((id(b_schedule_plan.builder), b.mb))
        if f is None:
            return None
        return f.loss if f_schedule_plan.builder.chunk.post_process else call.output


class _DriverCall:
    """One ``run`` call's chunk I/O: each P2P hook runs once per forward and backward (None if nothing is sent)."""

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

    def unbind(self) -> None:
        """Drops this call's hooks from the microbatches' I/O: they would chain each finished microbatch, and what
        its nodes hold, to the next until Python's garbage collector ran."""
        for plan in (self.f_plan, self.b_plan):
            if plan is not None:
                io = plan.nodes.io
                io.input = io.grad = io.send_output = io.send_grad = None

    def post_what_is_left(self) -> None:
        if self.f_plan is not None and FORWARD not in self.posted:
            self.post_forward(None)
        if self.b_plan is not None and BACKWARD not in self.posted:
            self.post_backward(None)


CHUNK_ADAPTERS = {GPTModel: McoreGPTChunk, HybridModel: McoreHybridChunk}


def chunk_for(model: torch.nn.Module, *, delay_wgrad: bool = False) -> McoreChunk:
    """The chunk adapter for a ``GPTModel``, ``HybridModel`` or Bridge's ``Qwen3VLModel``; else ValueError naming the
    fix."""
    for model_class, adapter_class in CHUNK_ADAPTERS.items():
        if isinstance(model, model_class):
            return adapter_class(model, delay_wgrad=delay_wgrad)
    if is_vision_language(model):
        return McoreVisionLanguageChunk(model, delay_wgrad=delay_wgrad)
    raise ValueError(
        f"{type(model).__name__}: the EP-overlap plan runs Megatron-Core's GPTModel and HybridModel and "
        "Megatron-Bridge's Qwen3VLModel (whole or a pipeline chunk), and no other model class yet; fix: build one of "
        "those, or turn overlap_moe_expert_parallel_comm off for this model"
    )


def checked_chunk(
    model: torch.nn.Module, attention_wgrad_window: int | None, high_priority: bool
) -> tuple[Settings, McoreChunk]:
    """The settings and chunk adapter the hook runs ``model`` with, after every check (no collective)."""
    config = model.config
    options = EPOverlapOptions(
        delay_wgrad=bool(config.delay_wgrad_compute),
        attention_wgrad_window=attention_wgrad_window,
        high_priority_comm=high_priority,
    )
    use_bridge_schedule(config)
    settings = resolve(config, options).checked()
    if settings.wgrad_window_auto:
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
    """``build_schedule_plan`` for one model chunk, with :func:`checked_chunk`'s settings and chunk adapter."""

    def __init__(self, session: _RankSession, settings: Settings, chunk: McoreChunk):
        self.settings, self.chunk, self.session = settings, chunk, session
        self.shape = ChunkShape.of(self.chunk)
        self._step, self._next_microbatch = 0, 0
        self.packed_guard = PackedGuard()  # reads position ids in a shape's first step only
        self.event = _HostEvent()  # one per chunk: Megatron-Core's loss node keeps the last plan's in a cycle

    @property
    def recorder(self) -> StepRecorder | None:
        """The current (or last) step's records on this rank: every all-to-all and compute node, by phase."""
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
        """Binds one microbatch for ``run``; takes the model forward's arguments (a VL model's images too)."""
        multimodal = dict(pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                          pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid_thw)  # fmt: skip
        inputs = {k: v for k, v in multimodal.items() if v is not None and k in self.chunk.bound_inputs}
        given = sorted(k for k, v in (unsupported | multimodal).items() if v is not None and k not in inputs)
        if decoder_input is not None:
            given.insert(0, "decoder_input")
        missing = []
        if self.packed_guard.dropped(packed_seq_params, position_ids, attention_mask):
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
            # Where Megatron-Core's build_schedule_plan calls it, so the stash's pages keep the recorded order.
            self.chunk.model.preprocess_for_paged_stash()
        start_offloading(self.chunk.model)
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
        input_tensor = None if self.chunk.pre_process else self.chunk.model.decoder.input_tensor
        return EPOverlapSchedulePlan(self, nodes, self.event, input_tensor)


def use_ep_overlap_schedule(
    models: list[torch.nn.Module],
    *,
    timeout: timedelta = DEFAULT_TIMEOUT,
    attention_wgrad_window: int | None = 1,
    full_recompute: tuple[str, int] | None = None,
) -> list[torch.nn.Module]:
    """Megatron-Bridge pre-wrap hook (``cfg.model.register_pre_wrap_hook``): Megatron-Core's driver runs our schedule.

    ``full_recompute=(method, layers)`` is set on the built config, since Megatron-Core's ``TransformerConfig`` refuses
    it beside the overlap flag when Bridge builds it. A refusal (``CommOverlapConfigError``/ValueError) is raised on
    every rank, before any collective.
    """
    config = models[0].config
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
    # A stage may refuse what another accepts (a chunk's MTP layer): all refuse, or one would wait for a gone peer.
    refuse_together(refusal)
    groups = mcore_ep_groups(timeout)
    agreement = Agreement()
    if torch.distributed.is_initialized() and groups.ep_size > 1:
        agreement = Agreement(gloo_group_like(groups.ep_group, timeout)[0])
    session = _RankSession(groups, high_priority, agreement)
    for model, (settings, chunk) in zip(models, checked):
        model.build_schedule_plan = EPOverlapPlanBuilder(session, settings, chunk)
    return models


use_ep_overlap_schedule.runs_bridge_schedule = True  # registered as a pre-wrap hook, it marks the config's schedule
