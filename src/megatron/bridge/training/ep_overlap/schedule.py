"""The 1F1B-interleaved MoE layer schedule that hides EP all-to-all behind the other microbatch's compute.

Contract:
    * :func:`layer_step` pairs the forward of layer j of one microbatch (F) with the backward of the mirrored layer
      of another (B). Host issue order is the schedule: each all-to-all of one microbatch is launched just before
      compute of the other microbatch, and waited for only when its consumer runs.
    * :class:`EPOverlapEngine` runs one training step over N microbatches in the order
      :func:`~megatron.bridge.training.ep_overlap.pipeline.pipeline_schedule` lists for this rank: with PP = 1,
      F(0); then F(i+1) paired with B(i) for i = 0..N-2; then B(N-1). With PP > 1 (and V model chunks per rank,
      Megatron-Core's interleaved layout) the same driver runs warm-up forwards, paired steady steps (forward of
      one chunk's microbatch with backward of another's, layer by layer; extra layers of the longer chunk run
      unpaired) and cool-down backwards, moving activations and gradients by P2P. With overlap off it runs the
      same order unpaired, each chunk through ordinary autograd (the plain path). Losses and every gradient are
      bitwise equal between the two and across pipeline layouts (tests check the bit patterns).
    * Gradients accumulate over microbatches as in the plain path; after the last microbatch, non-expert
      gradients are summed over the data-parallel group and expert gradients over the expert-DP group, once.
    * A chunk that offers ``update_router_biases(groups)`` gets it called once per training step, after the
      gradient sync (where Megatron-Core's ``finalize_model_grads`` moves its routers' expert biases).
    * A config the EP-overlap rules reject never reaches the engine: the constructor raises the same
      :class:`CommOverlapConfigError` that ``CommOverlapConfig.setup`` raises.
    * The loss of a step is the sum of token cross-entropies over every microbatch of every rank, divided by the
      number of tokens that count: labels equal to :data:`IGNORE_INDEX` count in neither. Microbatches may differ
      in size within a step and across ranks. Token ids and labels outside the vocabulary are refused on every
      rank at once (one small all-reduce per step carries the token count and any rank's bad input), with an
      error naming the rank and the microbatch, before any layer runs. Only the last pipeline stage has losses.
    * With ``delay_wgrad``: experts compute dgrad only in B.experts and their wgrad runs right after the
      dispatch-backward all-to-all is launched (window 3); attention wgrad runs after attention dgrad, in the
      next layer step's window 1, right after B's next combine-backward all-to-all is launched (windows 1 and 3
      have the least compute of their own). Every deferred wgrad runs exactly once per backward, within the same
      microbatch's backward; a leftover one at the end of a step is an error naming the module. With
      ``attention_wgrad_window=2`` the attention wgrad goes to window 2 instead (beside F.dispatch), for shapes
      whose window 2 is comm-bound; numerics are the same (each parameter still gets its contributions in the
      same order).
    * ``attention_wgrad_window=None`` (PP = 1) lets the engine place the attention wgrad: its first training step
      runs the plain path (the same numbers), and the planner picks the window from that step's costs
      (``placement.py``); every rank picks the same one.
    * A forward-only step with overlap at PP = 1 runs its forwards two by two (F(0) with F(1), ...), building no
      autograd graph; numerics are unchanged. Without overlap, or with PP > 1, it runs the plain path.
    * ``moe_ep_overlap_chunks=2`` (opt-in, PP = 1) splits the first and the last microbatch in two halves along
      the batch: where such a microbatch would run alone its halves run as a pair, and in a paired step they take
      its place node by node (``chunking.py``). It is the one option that is not bitwise equal to the plain path
      (a chunked microbatch's loss and gradients are summed from its halves).
    * The engine knows no model: it drives whatever offers the node functions (``nodes.py``) and the delayed-wgrad
      contract (``wgrad.py``).
"""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron.bridge.training.ep_overlap.chunking import ChunkSettings, HalvesNodes, Unit, chunk_problems
from megatron.bridge.training.ep_overlap.chunking import units as chunk_units
from megatron.bridge.training.ep_overlap.lanes import make_lane
from megatron.bridge.training.ep_overlap.nodes import ChunkIO, LayerNodes, MicrobatchNodes
from megatron.bridge.training.ep_overlap.p2p import PipelineP2P
from megatron.bridge.training.ep_overlap.pipeline import FORWARD, PipelineStep, pipeline_schedule
from megatron.bridge.training.ep_overlap.placement import WgradPlacement, choose_wgrad_window
from megatron.bridge.training.ep_overlap.records import CommRecord, ComputeRecord, StepRecorder, StepStats
from megatron.bridge.training.ep_overlap.wgrad import WGRAD_WINDOWS, check_no_pending_wgrads
from megatron.bridge.training.moe_overlap_rules import CommOverlapConfigError, check_moe_overlap
from megatron.bridge.utils.process_groups import EPGroups, all_reduce

logger = logging.getLogger(__name__)

Microbatch = tuple[torch.Tensor, torch.Tensor]  # (tokens [B, S], labels [B, S])
IGNORE_INDEX = -100  # a label that counts neither in the loss nor in its token count (PyTorch's convention)


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
    # window 1: B.combine backward (comm)   ||  F.pre_dispatch, [B's previous attention wgrad] (compute)
    b.combine_backward(b_grad_output)
    early = wgrad_window == 1 and not f.is_moe  # no split sizes to hide: beside F's previous combine instead
    if early:
        b_previous_wgrad()
    f.pre_dispatch(f_input())
    f.start_exchange()  # F's split sizes travel (and a slower peer catches up) while the wgrad computes
    if wgrad_window == 1 and not early:
        b_previous_wgrad()
    # window 2: F.dispatch (comm)           ||  [B's previous attention wgrad], B.experts backward, dgrad (compute)
    f.dispatch()  # the split-size host sync ends here, after F's compute (and the wgrad) was issued
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
    """F + B of one pipeline step: both chunks' starts, every layer pair, then both chunks' ends.

    F starts with its embedding or received activation; B with its loss backward or received gradient. Forward
    layer j pairs with backward layer n-1-j. When the two chunks differ in layer count, the longer one's extra
    layers run unpaired. Then F's activation goes out (when F's chunk is not the last), B's input gradient goes
    out (or its embedding backward runs), B's first layer's attention wgrad runs (while F's last combine is in
    flight, on the last chunk), and F ends with its head and loss.
    """
    f_output = f.forward_begin
    grad = b.backward_begin()
    b_wgrad: Callable[[], None] = lambda: None  # noqa: E731
    nf, nb = len(f.layers), len(b.layers)
    paired = min(nf, nb)
    for j in range(paired):
        f_output, grad, b_wgrad = layer_step(f.layers[j], f_output, b.layers[nb - 1 - j], grad, b_wgrad, wgrad_window)
    for j in range(paired, nb):  # B's chunk is longer
        b_wgrad()
        b_wgrad = lambda: None  # noqa: E731
        grad = b.layers[nb - 1 - j].backward(grad)
    for j in range(paired, nf):  # F's chunk is longer
        x = f.layers[j].forward(f_output())
        f_output = lambda x=x: x  # noqa: E731
    if not f.last:  # P2P in Megatron-Core's order: the activation, then the gradient
        f.forward_end(f_output())
    b.backward_end(grad)
    b_wgrad()
    if f.last:
        f.forward_end(f_output())


def forward_pair_step(a: MicrobatchNodes, b: MicrobatchNodes) -> None:
    """Two forwards interleaved layer by layer (the warm-up under edge pairing): each one's all-to-alls run while
    the other computes. Numerics are each microbatch's own."""
    a_output, b_output = a.forward_begin, b.forward_begin
    for fa, fb in zip(a.layers, b.layers):
        # A.pre_dispatch waits for A's previous combine while B's is still in flight
        fa.pre_dispatch(a_output())
        fa.dispatch()
        # A.dispatch (comm)  ||  B.pre_dispatch (compute)
        fb.pre_dispatch(b_output())
        fb.dispatch()
        # B.dispatch (comm)  ||  A.experts (compute)
        fa.experts()
        fa.combine()
        # A.combine (comm)   ||  B.experts (compute)
        fb.experts()
        fb.combine()
        # B.combine (comm)   ||  A's next layer (compute)
        a_output, b_output = fa.combine_finish, fb.combine_finish
    a.forward_end(a_output())
    b.forward_end(b_output())


def backward_pair_step(a: MicrobatchNodes, b: MicrobatchNodes) -> None:
    """Two backwards interleaved layer by layer (the cool-down under edge pairing). Every parameter gets A's
    gradient contribution before B's, as when they run one after the other, so numerics are unchanged."""
    a_grad, b_grad = a.backward_begin(), b.backward_begin()
    wgrads: list[Callable[[], None]] = []
    for la, lb in zip(reversed(a.layers), reversed(b.layers)):
        # A.combine backward (comm)  ||  [both previous layers' attention wgrads], B.combine backward (compute)
        la.combine_backward(a_grad)
        for wgrad in wgrads:
            wgrad()
        lb.combine_backward(b_grad)
        # B.combine backward (comm)  ||  A.experts backward
        la.experts_backward()
        la.dispatch_backward()
        la.expert_wgrad()
        # A.dispatch backward (comm) ||  B.experts backward, wgrad
        lb.experts_backward()
        lb.dispatch_backward()
        lb.expert_wgrad()
        # B.dispatch backward (comm) ||  A.pre_dispatch backward
        a_grad = la.pre_dispatch_backward()
        b_grad = lb.pre_dispatch_backward()
        wgrads = [la.attention_wgrad, lb.attention_wgrad]
    for wgrad in wgrads:
        wgrad()
    a.backward_end(a_grad)
    b.backward_end(b_grad)


@dataclass
class StepResult:
    """Outcome of one step on this rank."""

    losses: list[torch.Tensor]  # per microbatch: token-summed CE / (global tokens of the step)
    stats: StepStats
    recorder: StepRecorder


def delayable_linears(chunks) -> list:
    """Modules whose wgrad the schedule may defer (see ``wgrad.py``), over all layers of all ``chunks``."""
    return [linear for chunk in chunks for layer in chunk.layers for linear in layer.delayable_linears()]


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


def _microbatch_problems(microbatches: list[Microbatch], vocab_size: int, split: set[int]) -> list[str]:
    """What is wrong with this rank's microbatches (empty when nothing is), each naming the microbatch; those in
    ``split`` are chunked and need two sequences or more."""
    problems = []
    flags = []
    for i, (tokens, labels) in enumerate(microbatches):
        if tokens.dim() != 2 or tokens.shape != labels.shape:
            problems.append(
                f"microbatch {i}: tokens {tuple(tokens.shape)} and labels {tuple(labels.shape)} must both be [B, S]"
            )
        elif i in split and tokens.shape[0] < 2:
            problems.append(
                f"microbatch {i}: moe_ep_overlap_chunks=2 splits it in two along the batch, but it has "
                f"{tokens.shape[0]} sequence; fix: give it at least 2, or set moe_ep_overlap_chunks=1"
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
    """Runs training steps with the paired EP-overlap schedule, or the plain path, at any pipeline layout.

    Args:
        model: A whole model, or this pipeline rank's model chunks in virtual-stage order (Megatron-Core's
            layout: a list of V chunks, the first holding the embedding on pipeline rank 0 and the last the head on
            the last rank). A model or chunk offers ``config``, ``vocab_size``, ``layers`` with node functions and
            their global ``layer_numbers``, ``pre_process``/``post_process``, ``parameters``, and where it is the
            first/last chunk ``embed`` and ``head_loss`` (ignoring :data:`IGNORE_INDEX` labels); a whole model also
            a plain ``__call__``, a chunk ``hidden_shape``. The reference ``MoEGPTModel`` and the Megatron-Core plan
            do.
            Its ``config`` is checked against the EP-overlap rules.
        groups: This rank's process groups (with the pipeline group when PP > 1).
        overlap: Pair microbatches so all-to-all hides behind the other microbatch's compute.
        delay_wgrad: Defer expert/attention wgrad as described in the module docstring (needs overlap).
        attention_wgrad_window: With delayed wgrad, the window of the next layer step that runs a layer's attention
            wgrad: 1 (the default) or 2. None lets the engine choose (PP = 1): its first training step runs the
            plain path and the planner picks the window from that step's per-window costs (``placement.py``);
            ``engine.placement`` then says which it picked and why.
        high_priority_comm: On CUDA, give the comm stream high priority.
        edge_pairing: With overlap at PP = 1, pair the two forwards of the warm-up and the two backwards of the
            cool-down instead of running one microbatch alone at each end. Numerics are unchanged, but one more
            microbatch's activations are alive at the peak, so it is off unless asked for. PP > 1 ignores it.
        moe_ep_overlap_chunks: 2 splits each microbatch that would run alone (the first and the last; PP = 1) in
            two halves along the batch and runs them as a pair (``chunking.py``). Not bitwise: a chunked
            microbatch's loss and gradients are summed from two halves. 1 (the default) is off.
        launch_off_host: On CPU, with overlap, launch a step's all-to-alls in program order from one helper
            thread whenever one must wait or queue behind one that waits (``lanes.py``), so a dispatch waiting for
            its split sizes, i.e. for the slower rank, does not stop the host. It needs every layer to allow it
            (``exchange_splits_off_host``: the reference model's layers do, the Megatron-Core adapter's do not).
            None (the default) uses it wherever it applies, False never, True insists (an error where it cannot
            apply). Numerics are unchanged.

    Raises:
        CommOverlapConfigError: When the model config breaks an EP-overlap rule (same error as ``setup``).
        ValueError: When the chunks do not match the pipeline layout of ``groups`` and the config, or chunking is
            asked for where it cannot run (one line per problem, with its fix).
    """

    def __init__(
        self,
        model,
        groups: EPGroups,
        *,
        overlap: bool,
        delay_wgrad: bool = False,
        high_priority_comm: bool = False,
        attention_wgrad_window: int = 1,
        edge_pairing: bool = False,
        moe_ep_overlap_chunks: int = 1,
        launch_off_host: bool | None = None,
    ):
        if attention_wgrad_window is not None and attention_wgrad_window not in WGRAD_WINDOWS:
            raise ValueError(
                f"attention_wgrad_window must be one of {WGRAD_WINDOWS} or None (auto), got {attention_wgrad_window!r}"
            )
        if attention_wgrad_window is None and groups.pp_size > 1:
            raise ValueError(
                "attention_wgrad_window=None (auto) needs PP = 1: the planner that chooses simulates PP = 1; "
                f"set it to one of {WGRAD_WINDOWS}"
            )
        self.chunks = list(model) if isinstance(model, list | tuple) else [model]
        config = self.chunks[0].config
        violations = check_moe_overlap(
            config, overlap_moe_expert_parallel_comm=overlap, delay_wgrad_compute=delay_wgrad
        )
        if violations:
            raise CommOverlapConfigError(violations)
        problems = _layout_problems(self.chunks, config, groups)
        if problems:
            raise ValueError("the model chunks do not match the pipeline layout: " + "; ".join(problems))
        problems = chunk_problems(ChunkSettings(moe_ep_overlap_chunks, overlap, edge_pairing, groups.pp_size, config))
        if problems:
            raise ValueError("\n".join(problems))
        self.model, self.groups = model, groups
        self.overlap, self.delay_wgrad = overlap, delay_wgrad
        self.high_priority_comm = high_priority_comm
        self.attention_wgrad_window = attention_wgrad_window
        # Auto placement without delayed wgrad has nothing to place: window 1, decided now.
        if attention_wgrad_window is None and not (overlap and delay_wgrad):
            self.attention_wgrad_window = WGRAD_WINDOWS[0]
        self.placement: WgradPlacement | None = None
        self.edge_pairing = edge_pairing
        self.moe_ep_overlap_chunks = moe_ep_overlap_chunks
        self.launch_off_host = launch_off_host
        if launch_off_host:
            device = next(self.chunks[0].parameters()).device
            why = self._why_not_off_host(device)
            if why:
                raise ValueError(f"launch_off_host=True: {why}; leave it None (where it applies) or set it False")

    def _why_not_off_host(self, device: torch.device) -> str | None:
        if not self.overlap:
            return "it launches the overlapped schedule's all-to-alls, and overlap is off"
        if device.type != "cpu":
            return f"it is the CPU lane's; this model is on {device.type}"
        if not all(getattr(layer, "exchange_splits_off_host", False) for c in self.chunks for layer in c.layers):
            return "a layer of this model does not allow its split exchange off the host (exchange_splits_off_host)"
        return None

    def launches_off_host(self, device: torch.device) -> bool:
        """Whether an overlapped step on ``device`` launches its all-to-alls off the host thread."""
        wanted = self.launch_off_host is not False and self.groups.ep_size > 1
        return wanted and self._why_not_off_host(device) is None

    @classmethod
    def from_config(cls, model, groups: EPGroups, **kwargs) -> "EPOverlapEngine":
        """Reads ``overlap_moe_expert_parallel_comm`` and ``delay_wgrad_compute`` from the model config."""
        config = (model[0] if isinstance(model, list | tuple) else model).config
        return cls(
            model,
            groups,
            overlap=bool(config.overlap_moe_expert_parallel_comm),
            delay_wgrad=bool(config.delay_wgrad_compute),
            **kwargs,
        )

    def units(self, num_microbatches: int, *, overlap: bool | None = None, forward_only: bool = False) -> list[Unit]:
        """What runs as one sequence of nodes: each microbatch whole, or (chunking) its two halves in its place."""
        overlap = self.overlap if overlap is None else overlap
        return chunk_units(num_microbatches, self.moe_ep_overlap_chunks if overlap else 1, forward_only=forward_only)

    def schedule(
        self, num_microbatches: int, *, overlap: bool | None = None, forward_only: bool = False
    ) -> list[PipelineStep]:
        """This rank's order for a step of ``num_microbatches`` (what ``step`` executes); ``overlap`` None means
        the engine's."""
        return pipeline_schedule(
            self.groups.pp_size,
            len(self.chunks),
            num_microbatches,
            self.groups.pp_rank,
            overlap=self.overlap if overlap is None else overlap,
            forward_only=forward_only,
            edge_pairing=self.edge_pairing,
        )

    def step(self, microbatches: list[Microbatch], *, forward_only: bool = False) -> StepResult:
        """Forward (and unless ``forward_only``, backward and gradient sync) over ``microbatches``."""
        if not microbatches:
            raise ValueError("a step needs at least one microbatch")
        device = next(self.chunks[0].parameters()).device
        lane = make_lane(
            self.groups, device, high_priority=self.high_priority_comm, launch_off_host=self.launches_off_host(device)
        )
        normalizer = self._loss_token_count(microbatches, device, forward_only)
        placing = self.attention_wgrad_window is None and not forward_only
        start = time.perf_counter()
        failed = True
        try:
            if forward_only:
                # With overlap at PP = 1 the forwards run two by two, building no autograd graph.
                with torch.no_grad():
                    overlap = self.overlap and self.groups.pp_size == 1
                    losses = self._run(microbatches, normalizer, lane, device, overlap=overlap, forward_only=True)
            else:
                # While placing, the plain path: the same numbers, and its records are the planner's costs.
                losses = self._run(microbatches, normalizer, lane, device, overlap=self.overlap and not placing)
            failed = False
        finally:
            lane.close(failed=failed)
        if not forward_only:
            for chunk in self.chunks:
                sync_grads(chunk, self.groups)
                update_router_biases = getattr(chunk, "update_router_biases", None)
                if update_router_biases is not None:
                    update_router_biases(self.groups)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if placing:
            self.placement = choose_wgrad_window(
                lane.recorder,
                time.perf_counter() - start,
                len(microbatches),
                len(self.chunks[0].layers),
                self.groups,
                device,
                edge_pairing=self.edge_pairing,
                chunks=self.moe_ep_overlap_chunks,
                launch_off_host=lane.launches_off_host,
            )
            self.attention_wgrad_window = self.placement.window
        return StepResult([loss.detach() for loss in losses], lane.recorder.stats(), lane.recorder)

    def _loss_token_count(self, microbatches: list[Microbatch], device: torch.device, forward_only: bool) -> float:
        """Tokens that count in the loss, over every microbatch of every rank; refuses malformed input everywhere.

        Raises:
            ValueError: On every rank, when any rank's microbatch has mismatched shapes, a non-integer dtype, or
                token ids/labels outside the vocabulary; the offending rank's message names the microbatch.
        """
        initialized = torch.distributed.is_initialized()
        rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if initialized else (0, 1)
        plan = self.units(len(microbatches), forward_only=forward_only)
        split = {unit.microbatch for unit in plan if unit.half is not None}
        problems = [f"rank {rank}: {p}" for p in _microbatch_problems(microbatches, self.chunks[0].vocab_size, split)]
        # [tokens that count, then one "bad input" flag per rank]: one small collective for both.
        tally = torch.zeros(1 + world, dtype=torch.float64, device=device)
        if problems:
            tally[1 + rank] = 1
        elif self.chunks[-1].post_process:  # every pipeline stage has the data; one counts it
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

    # ---- the driver -------------------------------------------------------------------------------------

    def _run(
        self,
        microbatches: list[Microbatch],
        normalizer: float,
        lane,
        device: torch.device,
        *,
        overlap: bool,
        forward_only: bool = False,
    ) -> list[torch.Tensor]:
        """Executes this rank's :meth:`schedule`; returns the losses per microbatch (last pipeline stage only)."""
        plan = self.units(len(microbatches), overlap=overlap, forward_only=forward_only)
        halves_of = {unit.microbatch: u for u, unit in enumerate(plan) if unit.half == 0}
        whole = {unit.microbatch: u for u, unit in enumerate(plan) if unit.half is None}
        steps = self.schedule(len(microbatches), overlap=overlap, forward_only=forward_only)
        P, V = self.groups.pp_size, len(self.chunks)
        p2p = PipelineP2P(self.groups, lane, P * V, device) if P > 1 else None
        timeline = None if overlap else _PlainTimeline(lane)
        linears = delayable_linears(self.chunks)
        previous = [linear.delay_wgrad for linear in linears]
        runs: dict[tuple[int, int], MicrobatchNodes | _PlainRun] = {}
        losses: dict[int, torch.Tensor] = {}

        def nodes(u: int, chunk, io: ChunkIO) -> MicrobatchNodes:
            """The nodes of unit ``u`` (records are numbered by unit)."""
            tokens, labels = microbatches[plan[u].microbatch]
            rows = plan[u].rows(tokens.shape[0])
            return MicrobatchNodes(
                chunk, u, tokens[rows], labels[rows], normalizer, lane, self.delay_wgrad, io, grad=not forward_only
            )

        def run_of(microbatch: int, virtual: int) -> "MicrobatchNodes | HalvesNodes | _PlainRun":
            if (microbatch, virtual) not in runs:
                chunk, io = self.chunks[virtual], ChunkIO()
                if not overlap:
                    tokens, labels = microbatches[microbatch]
                    run = _PlainRun(chunk, microbatch, tokens, labels, normalizer, io, timeline)
                elif microbatch in halves_of:
                    u = halves_of[microbatch]
                    run = HalvesNodes(microbatch, nodes(u, chunk, io), nodes(u + 1, chunk, io))
                else:
                    run = nodes(whole[microbatch], chunk, io)
                runs[(microbatch, virtual)] = run
            return runs[(microbatch, virtual)]

        def shape_of(transfer) -> tuple[int, ...]:
            return self.chunks[0].hidden_shape(microbatches[transfer.microbatch][0])

        dtype = next(self.chunks[0].parameters()).dtype
        try:
            for linear in linears:
                linear.delay_wgrad = overlap and self.delay_wgrad
            if p2p is not None and steps:
                p2p.post(steps[0].recv, shape_of, dtype)
            for i, step in enumerate(steps):
                if p2p is not None and i + 1 < len(steps):  # receives are posted one step ahead
                    p2p.post(steps[i + 1].recv, shape_of, dtype)
                lane.recorder.phase = step.phase if overlap else "plain"
                f = run_of(*step.forward) if step.forward is not None else None
                b = run_of(*step.backward) if step.backward is not None else None
                partner = run_of(*step.partner) if step.partner is not None else None
                if p2p is not None:
                    _connect(step, f, b, p2p)
                if step.paired:
                    paired_microbatch_step(f, b, self.attention_wgrad_window)
                elif partner is not None and f is not None:
                    forward_pair_step(f, partner)
                elif partner is not None:
                    backward_pair_step(b, partner)
                elif isinstance(f, HalvesNodes):  # a chunked microbatch alone: its halves pair with each other
                    forward_pair_step(*f.halves)
                elif f is not None:
                    f.forward()
                elif isinstance(b, HalvesNodes):
                    backward_pair_step(*b.halves)
                else:
                    b.backward()
                for run, at in ((f, step.forward), (partner if f is not None else None, step.partner)):
                    if run is not None and run.last:
                        losses[at[0]] = run.loss
                if b is not None:
                    del runs[step.backward]
                    if partner is not None:
                        del runs[step.partner]
                if forward_only:  # nothing comes back for these microbatches: drop their activations now
                    runs.pop(step.forward, None)
                    runs.pop(step.partner, None)
            if p2p is not None:
                p2p.finish()
            check_no_pending_wgrads(linears)
        finally:
            for linear, value in zip(linears, previous):
                linear.reset_pending()
                linear.delay_wgrad = value
            if timeline is not None:
                timeline.detach(self.chunks)
        return [losses[m] for m in sorted(losses)]


def _connect(step: PipelineStep, f, b, p2p: PipelineP2P) -> None:
    """Hands the step's received tensors to its runs, and their sends to the P2P."""
    for transfer in step.recv:
        if transfer.kind == FORWARD:
            f.io.input = p2p.take(transfer)
        else:
            b.io.grad = p2p.take(transfer)
    for transfer in step.send:
        if transfer.kind == FORWARD:
            f.io.send_output = lambda x, t=transfer: p2p.send(t, x)
        else:
            b.io.send_grad = lambda g, t=transfer: p2p.send(t, g)


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


class _PlainTimeline:
    """Records the plain path as the overlapped path is recorded, so both arms of an A/B draw and compare alike:
    every all-to-all, and the compute between them as one segment each, named ``plain <next>`` after the
    boundary that ends it (``plain dispatch`` of layer j is everything computed since the previous all-to-all up
    to layer j's dispatch; ``plain forward_end``/``plain backward_end`` close a chunk's forward and backward)."""

    def __init__(self, lane):
        self.lane = lane
        self.open_ops: dict[str, CommRecord] = {}
        self.segment: ComputeRecord | None = None

    def start(self, microbatch: int) -> None:
        clock = self.lane.recorder.clock
        self.segment = ComputeRecord("plain", -1, microbatch, "plain", clock.mark(), time.perf_counter())

    def end(self, next_boundary: str, layer: int) -> None:
        record = self.segment
        record.node, record.layer = f"plain {next_boundary}", layer
        record.end, record.end_host = self.lane.recorder.clock.mark(), time.perf_counter()
        self.lane.recorder.compute.append(record)

    def observe(self, op: str, event: str, sent: int, received: int, layer: int, microbatch: int) -> None:
        # Blocking all-to-alls: launched and waited for at once.
        if event == "start":
            self.end(op, layer)
            record = self.lane.record_comm(op, layer, microbatch, exchanged=(sent, received))
            record.wait_start_host = record.launch_host
            self.open_ops[op] = record
        else:
            record = self.open_ops.pop(op)
            record.done, record.wait_end_host = self.lane.recorder.clock.mark(), time.perf_counter()
            self.start(microbatch)

    def attach(self, chunk, microbatch: int) -> None:
        for number, layer in zip(chunk.layer_numbers, chunk.layers):
            if hasattr(layer, "comm_observer"):
                layer.comm_observer = lambda op, event, sent, got, j=number: self.observe(
                    op, event, sent, got, j, microbatch
                )

    def detach(self, chunks) -> None:
        for chunk in chunks:
            for layer in chunk.layers:
                if hasattr(layer, "comm_observer"):
                    layer.comm_observer = None


class _PlainRun:
    """One microbatch through one chunk by ordinary autograd; the all-to-alls block (the reference path).

    A whole model runs its own plain ``__call__``; a pipeline chunk runs embedding or received input, its layers'
    ``forward``, then head and loss or a send.
    """

    def __init__(self, chunk, microbatch: int, tokens, labels, normalizer: float, io: ChunkIO, timeline):
        self.chunk, self.mb, self.io, self.timeline = chunk, microbatch, io, timeline
        self.tokens, self.labels, self.normalizer = tokens, labels, normalizer
        self.first, self.last = chunk.pre_process, chunk.post_process
        self.loss: torch.Tensor | None = None

    def forward(self) -> None:
        received = None if self.first else self.io.input.wait()  # before the segment: waiting is not compute
        self.timeline.attach(self.chunk, self.mb)
        self.timeline.start(self.mb)
        if self.first and self.last:
            self.loss = self.chunk(self.tokens, self.labels, self.normalizer)
        else:
            x = self.chunk.embed(self.tokens) if self.first else received.requires_grad_(True)
            self.input = x
            for layer in self.chunk.layers:
                x = layer(x)
            if self.last:
                self.loss = self.chunk.head_loss(x, self.labels, self.normalizer)
            else:
                self.output = x
                self.io.send_output(x)
        self.timeline.end("forward_end", -1)

    def backward(self) -> None:
        grad = None if self.last else self.io.grad.wait()
        self.timeline.attach(self.chunk, self.mb)
        self.timeline.start(self.mb)
        if self.last:
            self.loss.backward()
        else:
            self.output.backward(grad)
        if not self.first:
            self.io.send_grad(self.input.grad)
        self.input = self.output = None
        self.timeline.end("backward_end", -1)
