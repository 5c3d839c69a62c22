"""The engine: executes a rank's schedule program, one training (or forward-only) step at a time.

Contract:
    * :class:`Engine` runs the steps :func:`~ep_overlap_lab.program.steps.program` yields for this
      rank: it binds each unit to its nodes (or, with overlap off, to the plain path) and calls every op's method
      in the program's order (``program.interpreter.run_ops``, the planner's loop too). It knows no variant of the
      schedule: edge pairing, chunking, forward-only steps and pipeline parallelism are inputs of the program.
    * Losses and every gradient are bitwise equal between the overlapped and the plain path, and across pipeline
      layouts; ``moe_ep_overlap_chunks=2`` is the one option that is not (``program/units.py``).
    * Gradients accumulate over microbatches as in the plain path; after the last microbatch, non-expert
      gradients are summed over the data-parallel group and expert gradients over the expert-DP group, once. The
      step's synced gradient is then added to what ``.grad`` (or ``main_grad``) held before it, as autograd and
      Megatron-Core's buffers accumulate (``grads.HeldGradients``): no earlier step is summed again. Every chunk's
      step hooks (``step_hooks.py``: no-ops unless the chunk overrides them, Megatron-Core's for its plans) are
      called: ``update_router_biases`` once per training step after that sync (where Megatron-Core's
      ``finalize_model_grads`` moves its routers' expert biases); ``sync_pipeline_copies`` with the data-parallel
      sync (a weight held on two pipeline stages, such as a tied or MTP embedding, gets its copies' gradients
      summed); ``start_step(loss)`` before the step runs, with the step's ``step_loss.StepLoss`` (its
      loss-carrying units, data-parallel size and token count: what an auxiliary loss's backward scale is set from,
      per step, so no state another driver left in the process changes a result), and ``finish_step()`` after it,
      done or failed.
    * A training step under ``torch.no_grad()`` is refused, on every path, before it runs anything; a forward-only
      step (``forward_only=True``) runs without gradients whatever the grad mode.
    * With ``check_for_nan_in_loss_and_grad`` (on by default, as in Megatron-Core) a loss or gradient that is not
      finite fails every rank at once, naming the rank and the microbatch (``inputs.check_finite``); the
      parameters' gradients are then as they were before the step.
    * Options come in one :class:`~megatron.bridge.training.ep_overlap.options.EPOverlapOptions`, resolved and
      checked by the rules table when the engine is built (``settings.resolve``, kept as ``engine.settings``): what
      it refuses raises the same :class:`CommOverlapConfigError` that ``CommOverlapConfig.setup``, the harness and
      the Megatron-Core hook raise. The program gets what the settings resolved (whether wgrad is delayed, the
      attention wgrad's window); the engine derives neither. An automatic window is chosen by ``EPOverlapEngine``
      (``ep_overlap_engine.py``); this class refuses an overlapped training step until it is chosen.
    * The loss of a step is the sum of token cross-entropies over every microbatch of every rank, divided by the
      number of tokens that count (``inputs.py``); only the last pipeline stage has losses.
    * With delayed wgrad every deferred weight gradient runs once, within its own microbatch's backward, where the
      program puts it; one left queued at the end of a step is an error naming the module.
    * ``StepResult.activation_peak_bytes`` is the most this rank held for backward at once during the step
      (``saved.py``): what the schedule costs in activation memory, exact and deterministic.
"""

import functools
import operator
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ep_overlap_lab.engine.grads import HeldGradients, delayable_linears, sync_grads
from ep_overlap_lab.engine.inputs import Microbatch, check_finite, loss_token_count
from ep_overlap_lab.engine.off_host_lane import lane_for
from ep_overlap_lab.engine.p2p import PipelineP2P
from ep_overlap_lab.engine.plain import PlainRun, PlainTimeline
from ep_overlap_lab.engine.saved import SavedActivations
from ep_overlap_lab.engine.step_hooks import step_hooks, with_pipeline_group
from ep_overlap_lab.program.steps import Step, program
from ep_overlap_lab.program.units import Unit
from ep_overlap_lab.step_loss import StepLoss
from ep_overlap_lab.step_stats import StepStats, step_stats
from ep_overlap_lab.wgrad_store import check_contract, check_no_pending_wgrads
from megatron.bridge.training.ep_overlap.options import EPOverlapOptions
from megatron.bridge.training.ep_overlap.program.interpreter import run_ops
from megatron.bridge.training.ep_overlap.program.pipeline import BACKWARD, FORWARD
from megatron.bridge.training.ep_overlap.program.steps import ChunkShape
from megatron.bridge.training.ep_overlap.runtime.nodes import ChunkIO, MicrobatchNodes, UnitInput
from megatron.bridge.training.ep_overlap.runtime.records import StepRecorder
from megatron.bridge.training.ep_overlap.settings import Settings, resolve
from megatron.bridge.utils.process_groups import EPGroups


@dataclass
class StepResult:
    """Outcome of one step on this rank."""

    losses: list[torch.Tensor]  # per microbatch: token-summed CE / (global tokens of the step)
    stats: StepStats
    recorder: StepRecorder
    activation_peak_bytes: int = 0  # the most held for backward at once on this rank (``saved.SavedActivations``)


def _group_size(group) -> int:
    return torch.distributed.get_world_size(group) if group is not None and torch.distributed.is_initialized() else 1


# Where a P2P transfer of each kind meets a unit's chunk I/O: (what it receives into, what sends it).
_IO = {FORWARD: ("input", "send_output"), BACKWARD: ("grad", "send_grad")}


def _connect(step: Step, runners: dict, p2p: PipelineP2P) -> None:
    """Hands the step's received tensors to its units, and their sends to the P2P."""
    for transfer in step.recv:
        setattr(runners[step.unit_for(transfer).unit].io, _IO[transfer.kind][0], p2p.take(transfer))
    for transfer in step.send:
        send = functools.partial(p2p.send, transfer)
        setattr(runners[step.unit_for(transfer).unit].io, _IO[transfer.kind][1], send)


def _layout_problems(chunks: list, config, groups: EPGroups) -> list[str]:
    """What does not match between the chunks, the config's pipeline sizes and the process groups."""
    P, V = groups.pp_size, len(chunks)
    problems = []
    if (config.pipeline_model_parallel_size or 1) != P:
        problems.append(f"pipeline_model_parallel_size={config.pipeline_model_parallel_size} but the pipeline has {P}")
    if (config.virtual_pipeline_model_parallel_size or 1) != V:
        problems.append(
            f"virtual_pipeline_model_parallel_size={config.virtual_pipeline_model_parallel_size} but this rank has "
            f"{V} model chunks"
        )
    first = groups.pp_rank == 0
    last = groups.pp_rank == P - 1
    if chunks[0].pre_process != first or any(c.pre_process for c in chunks[1:]):
        problems.append("only the first chunk of pipeline rank 0 may hold the embedding")
    if chunks[-1].post_process != last or any(c.post_process for c in chunks[:-1]):
        problems.append("only the last chunk of the last pipeline rank may hold the head")
    return problems


class Engine:
    """Runs training steps with the EP-overlap schedule, or the plain path, at any pipeline layout.

    Args:
        model: A whole model, or this pipeline rank's model chunks in virtual-stage order (Megatron-Core's layout:
            the first holding the embedding on pipeline rank 0, the last the head on the last rank); each a
            :class:`~megatron.bridge.training.ep_overlap.contract.ChunkModel` (the reference ``MoEGPTModel`` and
            the Megatron-Core plan are). Its ``config`` is checked against the EP-overlap rules.
        groups: This rank's process groups. With PP > 1 and no pipeline group (``mcore_ep_groups``), the engine
            creates a gloo one (its P2P matches by tag): then every rank builds its engine together.
        options: The schedule's options; or give its fields as keywords (``overlap=True, delay_wgrad=True``).

    Raises:
        CommOverlapConfigError: When the config and options break an EP-overlap rule (one line each, with its fix).
        ValueError: When the chunks do not match the pipeline layout, a chunk needs another driver
            (``StepHooks.engine_problems``), or ``launch_off_host=True`` cannot apply.
    """

    def __init__(self, model, groups: EPGroups, options: EPOverlapOptions | None = None, **fields):
        if options is not None and fields:
            raise TypeError(f"give options or its fields, not both (got options and {sorted(fields)})")
        options = options or EPOverlapOptions(**fields)
        self.chunks = list(model) if isinstance(model, list | tuple) else [model]
        config = self.chunks[0].config
        self.settings = resolve(config, options).checked()  # the options first: they need only the config
        check_contract(self.chunks)
        self.step_hooks = [step_hooks(chunk) for chunk in self.chunks]
        problems = self.step_hooks[0].engine_problems()
        if problems:
            raise ValueError("the EP-overlap engine cannot run this model: " + "; ".join(problems))
        unreplayed = [
            type(layer).__name__
            for chunk in self.chunks
            if chunk.recompute_segments
            for layer in chunk.layers
            if not layer.replays_forward
        ]
        if unreplayed:
            raise ValueError(
                f"recompute_granularity='full': {sorted(set(unreplayed))} cannot replay their forward in backward "
                "(LayerHooks.replays_forward); fix: set recompute_granularity=None or 'selective'"
            )
        groups = with_pipeline_group(groups)  # a collective with PP > 1: every rank builds its engine at once
        problems = _layout_problems(self.chunks, config, groups)
        if problems:
            raise ValueError("the model chunks do not match the pipeline layout: " + "; ".join(problems))
        self.model, self.groups = model, groups
        self.shapes = [ChunkShape.of(chunk) for chunk in self.chunks]
        if options.launch_off_host:
            why = self._why_not_off_host(options, next(self.chunks[0].parameters()).device)
            if why:
                raise ValueError(f"launch_off_host=True: {why}; leave it None (where it applies) or set it False")

    @classmethod
    def from_config(cls, model, groups: EPGroups, **fields) -> "Engine":
        """Overlap and delayed wgrad as the model config resolves them; other options from ``fields``."""
        config = (model[0] if isinstance(model, list | tuple) else model).config
        return cls(model, groups, EPOverlapOptions.from_config(config, **fields))

    @property
    def options(self) -> EPOverlapOptions:
        """The schedule's options as the steps run them (with the window the planner chose, once it has)."""
        return self.settings.options

    @property
    def attention_wgrad_window(self) -> int | None:
        """The attention wgrad's window the overlapped steps run with; None while the planner is still to choose
        it (``Settings.wgrad_window_auto``)."""
        return None if self.settings.wgrad_window_auto else self.settings.attention_wgrad_window

    def _why_not_off_host(self, options: EPOverlapOptions, device: torch.device) -> str | None:
        if not options.overlap:
            return "it launches the overlapped schedule's all-to-alls, and overlap is off"
        if device.type != "cpu":
            return f"it is the CPU lane's; this model is on {device.type}"
        if not all(layer.exchange_splits_off_host for c in self.chunks for layer in c.layers):
            return "a layer of this model does not allow its split exchange off the host (exchange_splits_off_host)"
        return None

    def launches_off_host(self, device: torch.device, options: EPOverlapOptions | None = None) -> bool:
        """Whether an overlapped step on ``device`` launches its all-to-alls off the host thread."""
        options = options or self.options
        wanted = options.launch_off_host is not False and self.groups.ep_size > 1
        return wanted and self._why_not_off_host(options, device) is None

    def schedule(
        self, num_microbatches: int, *, forward_only: bool = False, settings: Settings | None = None
    ) -> list[Step]:
        """This rank's program for a step of ``num_microbatches`` (what :meth:`step` executes), as ``settings``
        (default: the engine's) resolved the options."""
        settings = settings or self.settings
        return list(
            program(
                settings.options,
                self.shapes,
                num_microbatches,
                pipeline_size=self.groups.pp_size,
                rank=self.groups.pp_rank,
                forward_only=forward_only,
                delay_wgrad=settings.delay_wgrad,
                window=settings.attention_wgrad_window,
            )
        )

    def step(self, microbatches: list[Microbatch], *, forward_only: bool = False) -> StepResult:
        """Forward (and unless ``forward_only``, backward and gradient sync) over ``microbatches``."""
        return self._step(microbatches, self.settings, forward_only)

    def _step(self, microbatches: list[Microbatch], settings: Settings, forward_only: bool) -> StepResult:
        if not microbatches:
            raise ValueError("a step needs at least one microbatch")
        if not forward_only and not torch.is_grad_enabled():  # the nodes would train anyway; the plain path fails
            raise RuntimeError(
                "step() under torch.no_grad(): a training step needs autograd; call step(microbatches, "
                "forward_only=True) for a forward-only step (it runs without gradients itself), or leave no_grad"
            )
        if not forward_only and settings.wgrad_window_auto:
            raise ValueError("attention_wgrad_window=None (auto) is chosen by EPOverlapEngine; give 1 or 2 here")
        options = settings.options
        device = next(self.chunks[0].parameters()).device
        lane = lane_for(
            self.groups,
            device,
            high_priority=options.high_priority_comm,
            launch_off_host=self.launches_off_host(device, options),
        )
        steps = self.schedule(len(microbatches), forward_only=forward_only, settings=settings)
        split = {member.microbatch for s in steps for member in s.units if member.half is not None}
        normalizer = loss_token_count(microbatches, self.chunks, split, self.groups, device)
        held = None if forward_only else HeldGradients(self._named_parameters())
        loss = StepLoss(len(microbatches) + len(split), _group_size(self.groups.dp_group), normalizer)
        for hooks in self.step_hooks:
            hooks.start_step(loss)
        failed = True
        saved = SavedActivations(p for chunk in self.chunks for p in chunk.parameters())
        lane.saved = saved
        try:
            with torch.no_grad() if forward_only else nullcontext(), saved:
                losses = self._run(steps, microbatches, normalizer, lane, device, forward_only)
            if options.check_for_nan_in_loss_and_grad:
                check_finite(losses, held.contributions() if held else [], self.groups, device)
            if held is not None:
                for chunk, hooks in zip(self.chunks, self.step_hooks):
                    sync_grads(chunk, self.groups)
                    hooks.sync_pipeline_copies(self.groups)
                held.restore(add=True)
            failed = False
        finally:
            lane.close(failed=failed)
            if failed and held is not None:
                held.restore(add=False)
            for hooks in reversed(self.step_hooks):  # last started, first finished: each puts back what it found
                hooks.finish_step()
        if not forward_only:
            for hooks in self.step_hooks:
                hooks.update_router_biases(self.groups)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return StepResult(
            [loss.detach() for loss in losses], step_stats(lane.recorder), lane.recorder, saved.peak_bytes
        )

    def _named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        prefix = len(self.chunks) > 1
        return [
            (f"chunk{v}.{name}" if prefix else name, param)
            for v, chunk in enumerate(self.chunks)
            for name, param in chunk.named_parameters()
            if param.requires_grad
        ]

    def _unit_runner(
        self, member, microbatch, normalizer, lane, timeline, *, grad: bool
    ) -> MicrobatchNodes | PlainRun:
        """A unit's nodes on its chunk, or its plain run there (``timeline`` given: overlap off)."""
        chunk = self.chunks[member.virtual]
        tokens, labels, *packed = microbatch
        if packed and packed[0] is not None:  # a packed (THD) microbatch: the chunk's view of it
            chunk = chunk.with_packed_sequences(packed[0])
        rows = Unit(member.microbatch, member.half).rows(tokens.shape[0])
        unit = UnitInput(chunk, member.unit, tokens[rows], labels[rows], normalizer)
        if timeline is not None:
            return PlainRun(unit, ChunkIO(), timeline)
        return MicrobatchNodes(unit, lane, ChunkIO(), grad=grad)

    def _run(self, steps, microbatches, normalizer, lane, device, forward_only) -> list[torch.Tensor]:
        """Executes ``steps``; returns the losses per microbatch (last pipeline stage only)."""
        P, V = self.groups.pp_size, len(self.chunks)
        p2p = PipelineP2P(self.groups, lane, P * V, device) if P > 1 else None
        plain = any(step.plain for step in steps)
        timeline = PlainTimeline(lane) if plain else None
        linears = delayable_linears(self.chunks)
        previous = [linear.delay_wgrad for linear in linears]
        runners: dict[tuple[int, int], MicrobatchNodes | PlainRun] = {}
        losses: dict[int, list[torch.Tensor]] = {}

        def runner(member) -> MicrobatchNodes | PlainRun:
            """The nodes (or plain run) of a unit on its chunk, made when the unit first reaches the chunk."""
            key = (member.unit, member.virtual)
            if key not in runners:
                runners[key] = self._unit_runner(member, microbatches[member.microbatch], normalizer, lane, timeline,
                                                 grad=not forward_only)  # fmt: skip
            return runners[key]

        def shape_of(transfer) -> tuple[int, ...]:
            return self.chunks[0].hidden_shape(microbatches[transfer.microbatch][0])

        dtype = next(self.chunks[0].parameters()).dtype
        try:
            delay_wgrad = any(step.delay_wgrad for step in steps)
            for linear in linears:
                linear.delay_wgrad = delay_wgrad
            if p2p is not None and steps:
                p2p.post(steps[0].recv, shape_of, dtype)
            for i, step in enumerate(steps):
                if p2p is not None and i + 1 < len(steps):  # receives are posted one step ahead
                    p2p.post(steps[i + 1].recv, shape_of, dtype)
                lane.recorder.phase = step.phase
                bound = {member.unit: runner(member) for member in step.units}
                if p2p is not None:
                    _connect(step, bound, p2p)
                with nullcontext() if step.plain else self.chunks[0].step_context():
                    run_ops(step.ops, bound)
                for member in step.units:
                    if member.role == FORWARD and self.chunks[member.virtual].post_process:
                        losses.setdefault(member.microbatch, []).append(bound[member.unit].loss)
                    if member.done:
                        del runners[(member.unit, member.virtual)]
            if p2p is not None:
                p2p.finish()
            check_no_pending_wgrads(linears)
        finally:
            for linear, value in zip(linears, previous):
                linear.reset_pending()
                linear.delay_wgrad = value
            if timeline is not None:
                timeline.detach(self.chunks)
        # A chunked microbatch's loss is its halves' sum, first half first.
        return [functools.reduce(operator.add, losses[m]) for m in sorted(losses)]
