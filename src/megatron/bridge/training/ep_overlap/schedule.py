"""The 1F1B-interleaved MoE layer schedule (PP = 1) that hides EP all-to-all behind the other microbatch's compute.

Contract:
    * :func:`layer_step` pairs the forward of layer j of microbatch i+1 (F) with the backward of layer L-1-j of
      microbatch i (B). Host issue order is the schedule: each all-to-all of one microbatch is launched just
      before compute of the other microbatch, and waited for only when its consumer runs.
    * :class:`EPOverlapEngine` runs one training step over N microbatches: F(0); then F(i+1) paired with B(i)
      for i = 0..N-2; then B(N-1). With overlap off it runs the same model through the plain forward/backward.
      Losses and every gradient are bitwise equal between the two (tests check the bit patterns).
    * Gradients accumulate over microbatches as in the plain path; after the last microbatch, non-expert
      gradients are summed over the data-parallel group and expert gradients over the expert-DP group, once.
    * A config the EP-overlap rules reject never reaches the engine: the constructor raises the same
      :class:`CommOverlapConfigError` that ``CommOverlapConfig.setup`` raises.
    * The loss of a step is the sum of token cross-entropies over every microbatch of every rank, divided by the
      number of tokens that count: labels equal to :data:`IGNORE_INDEX` count in neither. Microbatches may differ
      in size within a step and across ranks. Token ids and labels outside the vocabulary are refused on every
      rank at once (one small all-reduce per step carries the token count and any rank's bad input), with an
      error naming the rank and the microbatch, before any layer runs.
    * With ``delay_wgrad``: experts compute dgrad only in B.experts and their wgrad runs right after the
      dispatch-backward all-to-all is launched (window 3); attention wgrad runs after attention dgrad, in the
      next layer step's window 1, right after B's next combine-backward all-to-all is launched (windows 1 and 3
      have the least compute of their own). Every deferred wgrad runs exactly once per backward, within the same
      microbatch's backward; a leftover one at the end of a step is an error naming the module. With
      ``attention_wgrad_window=2`` the attention wgrad goes to window 2 instead (beside F.dispatch), for shapes
      whose window 2 is comm-bound; numerics are the same (each parameter still gets its contributions in the
      same order).
"""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megatron.bridge.models.moe_gpt.grouped_linear import GroupedLinear, TEGroupedLinear, check_no_pending_wgrads
from megatron.bridge.models.moe_gpt.model import MoEGPTModel

if TYPE_CHECKING:
    from megatron.bridge.training.ep_overlap.mcore import McoreGPTPlan
from megatron.bridge.training.ep_overlap.lanes import make_lane
from megatron.bridge.training.ep_overlap.nodes import LayerNodes, MicrobatchNodes
from megatron.bridge.training.ep_overlap.records import CommRecord, ComputeRecord, StepRecorder, StepStats
from megatron.bridge.training.moe_overlap_rules import CommOverlapConfigError, check_moe_overlap
from megatron.bridge.utils.process_groups import EPGroups, all_reduce

logger = logging.getLogger(__name__)

Microbatch = tuple[torch.Tensor, torch.Tensor]  # (tokens [B, S], labels [B, S])
IGNORE_INDEX = -100  # a label that counts neither in the loss nor in its token count (PyTorch's convention)
WGRAD_WINDOWS = (1, 2)  # where a layer step may put the previous layer's delayed attention wgrad


def layer_step(
    f: LayerNodes,
    f_input: Callable[[], torch.Tensor],
    b: LayerNodes,
    b_grad_output: torch.Tensor,
    b_previous_wgrad: Callable[[], None],
    wgrad_window: int = 1,
) -> tuple[Callable[[], torch.Tensor], torch.Tensor, Callable[[], None]]:
    """One paired layer step: forward of ``f`` interleaved with backward of ``b``.

    ``f_input()`` yields F's input; for a layer after the first it finishes the previous layer's F.combine, so
    that all-to-all is waited for only after B's next all-to-all is already launched. ``b_previous_wgrad()`` is
    the delayed attention wgrad of B's previous layer (a no-op when wgrad is not delayed); it fills window
    ``wgrad_window``: 1 (beside B.combine backward) or 2 (beside F.dispatch), whichever has less compute of its own.

    Returns:
        (a callable that finishes F's combine and yields this layer's output, gradient of B's layer input,
        B's delayed attention wgrad of this layer, for the next step's window 1).
    """
    # window 1: B.combine backward (comm)   ||  [B's previous attention wgrad], F.pre_dispatch (compute)
    b.combine_backward(b_grad_output)
    if wgrad_window == 1:
        b_previous_wgrad()
    f.pre_dispatch(f_input())
    # window 2: F.dispatch (comm)           ||  [B's previous attention wgrad], B.experts backward, dgrad (compute)
    f.dispatch()  # split-size host sync happens here, after F's compute was issued
    if wgrad_window == 2:
        b_previous_wgrad()
    b.experts_backward()
    # window 3: B.dispatch backward (comm)  ||  B.experts wgrad (if delayed), F.experts (compute)
    b.dispatch_backward()
    b.expert_wgrad()
    f.experts()
    # window 4: F.combine (comm)            ||  B.pre_dispatch backward, dgrad (compute)
    f.combine()
    b_grad_input = b.pre_dispatch_backward()
    return f.combine_finish, b_grad_input, b.attention_wgrad


def paired_microbatch_step(f: MicrobatchNodes, b: MicrobatchNodes, wgrad_window: int = 1) -> None:
    """F(i+1) + B(i): embedding and loss backward first, then every layer pair, then loss and embedding backward."""
    f_output = f.embed_forward
    grad = b.head_backward()
    b_wgrad: Callable[[], None] = lambda: None  # noqa: E731
    num_layers = len(f.layers)
    for j in range(num_layers):
        f_output, grad, b_wgrad = layer_step(
            f.layers[j], f_output, b.layers[num_layers - 1 - j], grad, b_wgrad, wgrad_window
        )
    b_wgrad()  # B's first layer: its attention wgrad runs while F's last combine is in flight
    b.embed_backward(grad)
    f.head_forward(f_output())


@dataclass(frozen=True)
class Action:
    """One step of the driver on this rank: the forward of a microbatch, its backward, or both paired."""

    phase: str  # "warmup", "paired" or "cooldown"
    forward: int | None
    backward: int | None


def schedule_actions(num_microbatches: int) -> list[Action]:
    """The PP = 1 driver's order, as data (the engine runs it, the planner simulates it): F(0); F(i+1) paired with
    B(i) for i = 0..N-2; B(N-1). With one microbatch nothing is paired."""
    n = num_microbatches
    return [
        Action("warmup", 0, None),
        *(Action("paired", i + 1, i) for i in range(n - 1)),
        Action("cooldown", None, n - 1),
    ]


@dataclass
class StepResult:
    """Outcome of one step on this rank."""

    losses: list[torch.Tensor]  # per microbatch: token-summed CE / (global tokens of the step)
    stats: StepStats
    recorder: StepRecorder


def delayable_linears(model) -> list[GroupedLinear | TEGroupedLinear]:
    """Linears whose wgrad the schedule may defer, over all layers of ``model``."""
    return [linear for layer in model.layers for linear in layer.delayable_linears()]


def sync_grads(model: torch.nn.Module, groups: EPGroups) -> None:
    """Sums non-expert grads over the DP group and expert grads over the expert-DP group, one bucket each."""
    dense, expert = [], []
    for param in model.parameters():
        if param.requires_grad:
            (expert if getattr(param, "allreduce", True) is False else dense).append(param)
    for params, group, what in ((dense, groups.dp_group, "dense"), (expert, groups.expert_dp_group, "expert")):
        if group is None or torch.distributed.get_world_size(group) == 1 or not params:
            continue
        grads = []
        for param in params:
            main_grad = getattr(param, "main_grad", None)
            if main_grad is not None:
                grads.append(main_grad)
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads.append(param.grad)
        flat = torch.cat([g.reshape(-1) for g in grads])
        all_reduce(flat, group, op=f"{what} gradient all-reduce", timeout=groups.timeout)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _microbatch_problems(microbatches: list[Microbatch], vocab_size: int) -> list[str]:
    """What is wrong with this rank's microbatches (empty when nothing is), each naming the microbatch."""
    problems = []
    flags = []
    for i, (tokens, labels) in enumerate(microbatches):
        if tokens.dim() != 2 or tokens.shape != labels.shape:
            problems.append(
                f"microbatch {i}: tokens {tuple(tokens.shape)} and labels {tuple(labels.shape)} must both be [B, S]"
            )
        elif tokens.is_floating_point() or labels.is_floating_point():
            problems.append(
                f"microbatch {i}: tokens and labels must be integer ids, not {tokens.dtype}/{labels.dtype}"
            )
        else:
            bad_tokens = ((tokens < 0) | (tokens >= vocab_size)).any()
            bad_labels = (((labels < 0) & (labels != IGNORE_INDEX)) | (labels >= vocab_size)).any()
            flags.append((i, torch.stack([bad_tokens, bad_labels])))
    if flags:
        found = torch.stack([f for _, f in flags]).tolist()  # one host sync for every microbatch
        for (i, _), (bad_tokens, bad_labels) in zip(flags, found):
            tokens, labels = microbatches[i]
            if bad_tokens:
                problems.append(
                    f"microbatch {i}: token ids must be in [0, {vocab_size}), found {int(tokens.min())}.."
                    f"{int(tokens.max())}"
                )
            if bad_labels:
                problems.append(
                    f"microbatch {i}: labels must be in [0, {vocab_size}) or {IGNORE_INDEX} (ignored), found "
                    f"{int(labels.min())}..{int(labels.max())}"
                )
    return problems


class EPOverlapEngine:
    """Runs training steps with the paired EP-overlap schedule, or the plain path.

    Args:
        model: A reference ``MoEGPTModel`` or a Megatron-Core ``McoreGPTPlan`` (anything with ``config``,
            ``vocab_size``, ``layers`` with node functions, ``embed``, ``head_loss`` and a plain ``__call__`` that
            ignore :data:`IGNORE_INDEX` labels, and ``parameters``).
            Its ``config`` is checked against the EP-overlap rules.
        groups: This rank's process groups.
        overlap: Pair microbatches so all-to-all hides behind the other microbatch's compute.
        delay_wgrad: Defer expert/attention wgrad as described in the module docstring (needs overlap).
        attention_wgrad_window: With delayed wgrad, the window of the next layer step that runs a layer's attention
            wgrad: 1 (the default) or 2. The planner (``planner.best_plan``) says which suits a shape.
        high_priority_comm: On CUDA, give the comm stream high priority.

    Raises:
        CommOverlapConfigError: When the model config breaks an EP-overlap rule (same error as ``setup``).
    """

    def __init__(
        self,
        model: "MoEGPTModel | McoreGPTPlan",
        groups: EPGroups,
        *,
        overlap: bool,
        delay_wgrad: bool = False,
        high_priority_comm: bool = False,
        attention_wgrad_window: int = 1,
    ):
        if attention_wgrad_window not in WGRAD_WINDOWS:
            raise ValueError(f"attention_wgrad_window must be one of {WGRAD_WINDOWS}, got {attention_wgrad_window!r}")
        violations = check_moe_overlap(
            model.config, overlap_moe_expert_parallel_comm=overlap, delay_wgrad_compute=delay_wgrad
        )
        if violations:
            raise CommOverlapConfigError(violations)
        self.model, self.groups = model, groups
        self.overlap, self.delay_wgrad = overlap, delay_wgrad
        self.high_priority_comm = high_priority_comm
        self.attention_wgrad_window = attention_wgrad_window

    @classmethod
    def from_config(cls, model: "MoEGPTModel | McoreGPTPlan", groups: EPGroups, **kwargs) -> "EPOverlapEngine":
        """Reads ``overlap_moe_expert_parallel_comm`` and ``delay_wgrad_compute`` from ``model.config``."""
        config = model.config
        return cls(
            model,
            groups,
            overlap=bool(config.overlap_moe_expert_parallel_comm),
            delay_wgrad=bool(config.delay_wgrad_compute),
            **kwargs,
        )

    def step(self, microbatches: list[Microbatch], *, forward_only: bool = False) -> StepResult:
        """Forward (and unless ``forward_only``, backward and gradient sync) over ``microbatches``."""
        if not microbatches:
            raise ValueError("a step needs at least one microbatch")
        device = next(self.model.parameters()).device
        lane = make_lane(self.groups, device, high_priority=self.high_priority_comm)
        normalizer = self._loss_token_count(microbatches, device)
        if forward_only:
            with torch.no_grad():
                losses = [self.model(tokens, labels, normalizer) for tokens, labels in microbatches]
        elif self.overlap:
            losses = self._overlapped(microbatches, normalizer, lane)
        else:
            losses = self._plain(microbatches, normalizer, lane)
        if not forward_only:
            sync_grads(self.model, self.groups)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return StepResult([loss.detach() for loss in losses], lane.recorder.stats(), lane.recorder)

    def _loss_token_count(self, microbatches: list[Microbatch], device: torch.device) -> float:
        """Tokens that count in the loss, over every microbatch of every rank; refuses malformed input everywhere.

        Raises:
            ValueError: On every rank, when any rank's microbatch has mismatched shapes, a non-integer dtype, or
                token ids/labels outside the vocabulary; the offending rank's message names the microbatch.
        """
        initialized = torch.distributed.is_initialized()
        rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if initialized else (0, 1)
        problems = [f"rank {rank}: {p}" for p in _microbatch_problems(microbatches, self.model.vocab_size)]
        # [tokens that count, then one "bad input" flag per rank]: one small collective for both.
        tally = torch.zeros(1 + world, dtype=torch.float64, device=device)
        if problems:
            tally[1 + rank] = 1
        else:
            tally[0] = torch.stack([(labels != IGNORE_INDEX).sum() for _, labels in microbatches]).sum()
        if initialized:
            all_reduce(tally, None, op="loss token count", timeout=self.groups.timeout)
        counted, *flags = tally.tolist()  # the step's one host sync for this
        bad_ranks = [r for r, flag in enumerate(flags) if flag > 0]
        if bad_ranks:
            here = "; ".join(problems) if problems else "this rank's input is fine"
            raise ValueError(f"bad microbatch input on rank(s) {bad_ranks}: {here}")
        if counted == 0:
            raise ValueError(
                f"every label of this step is IGNORE_INDEX ({IGNORE_INDEX}): there is no loss to train on"
            )
        return counted

    # ---- the two paths ------------------------------------------------------------------------------

    def _overlapped(self, microbatches: list[Microbatch], normalizer: float, lane) -> list[torch.Tensor]:
        linears = delayable_linears(self.model)
        previous = [linear.delay_wgrad for linear in linears]
        try:
            for linear in linears:
                linear.delay_wgrad = self.delay_wgrad
            runs = [
                MicrobatchNodes(self.model, i, tokens, labels, normalizer, lane, self.delay_wgrad)
                for i, (tokens, labels) in enumerate(microbatches)
            ]
            for action in schedule_actions(len(runs)):
                lane.recorder.phase = action.phase
                if action.forward is not None and action.backward is not None:
                    paired_microbatch_step(runs[action.forward], runs[action.backward], self.attention_wgrad_window)
                elif action.forward is not None:
                    runs[action.forward].forward()
                else:
                    runs[action.backward].backward()
            check_no_pending_wgrads(linears)
            return [run.loss for run in runs]
        finally:
            for linear, value in zip(linears, previous):
                linear.reset_pending()
                linear.delay_wgrad = value

    def _plain(self, microbatches: list[Microbatch], normalizer: float, lane) -> list[torch.Tensor]:
        """Ordinary forward and backward per microbatch; the all-to-alls block.

        It records what the overlapped path records, so both arms of an A/B draw and compare alike: every
        all-to-all, and the compute between them as one segment each, named ``plain <next>`` after the boundary
        that ends it (``plain dispatch`` of layer j is everything computed since the previous all-to-all up to
        layer j's dispatch; ``plain forward_end``/``plain backward_end`` close the forward and the backward).
        """
        lane.recorder.phase = "plain"
        recorder, clock = lane.recorder, lane.recorder.clock
        open_ops: dict[str, CommRecord] = {}
        segment: list[ComputeRecord | None] = [None]

        def start_compute(microbatch: int) -> None:
            segment[0] = ComputeRecord("plain", -1, microbatch, "plain", clock.mark(), time.perf_counter())

        def end_compute(next_boundary: str, layer: int) -> None:
            record = segment[0]
            record.node, record.layer = f"plain {next_boundary}", layer
            record.end, record.end_host = clock.mark(), time.perf_counter()
            recorder.compute.append(record)

        def observe(op: str, event: str, sent: int, received: int, layer: int, microbatch: int) -> None:
            # Blocking all-to-alls: launched and waited for at once.
            if event == "start":
                end_compute(op, layer)
                record = lane.record_comm(op, layer, microbatch, exchanged=(sent, received))
                record.wait_start_host = record.launch_host
                open_ops[op] = record
            else:
                record = open_ops.pop(op)
                record.done, record.wait_end_host = clock.mark(), time.perf_counter()
                start_compute(microbatch)

        losses = []
        try:
            for i, (tokens, labels) in enumerate(microbatches):
                for j, layer in enumerate(self.model.layers):
                    if hasattr(layer, "comm_observer"):
                        layer.comm_observer = lambda op, event, sent, got, j=j, i=i: observe(
                            op, event, sent, got, j, i
                        )
                start_compute(i)
                loss = self.model(tokens, labels, normalizer)
                end_compute("forward_end", -1)
                start_compute(i)
                loss.backward()
                end_compute("backward_end", -1)
                losses.append(loss)
            # Nothing runs backward_dw() here: a module built to delay its wgrad would lose it.
            check_no_pending_wgrads(delayable_linears(self.model))
        finally:
            for layer in self.model.layers:
                if hasattr(layer, "comm_observer"):
                    layer.comm_observer = None
        return losses
