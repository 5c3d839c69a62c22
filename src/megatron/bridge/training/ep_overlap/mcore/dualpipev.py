"""DualPipeV as a Megatron-Core forward-backward function: :func:`forward_backward_dualpipev` takes the arguments of
Megatron-Core's schedules and runs this rank's op list (``program/dualpipev.py``) over its two model chunks.

Contract:
    * ``model`` is the rank's two chunks: ``model[0]`` stage r, ``model[1]`` stage 2P-1-r (rank 0: the embedding on
      stage 0, the output layer and loss on stage 2P-1); ``data_iterator`` one per chunk, or one for both.
    * With ``overlap_moe_expert_parallel_comm`` each step runs as one call of the plan's ``run(f_plan, b_plan)``,
      so an F&B step overlaps the forward of one chunk with the backward of the other, all-to-alls included; without
      it, Megatron-Core's ``forward_step``/``backward_step``, forward before backward.
    * Each P2P transfer is one message on the pipeline group tagged ``Transfer.tag`` (unique within the step), so the
      two ends need not post in one order; the last rank hands stage P-1's output to stage P without a message.
    * The chunks are built by ``dualpipev_chunks`` (``mcore/dualpipev_chunks.py``). MTP (and its copy of the
      embedding) or a tied output layer is on stage 2P-1, on rank 0 with the embedding: the embedding group is rank 0
      alone, and within ``finalize_model_grads_func`` each copy's gradient becomes their sum where the group's
      all-reduce makes it in 1F1B (before a per-token loss's division by the token count).
    * The W steps (deferred weight gradients) run nothing: every weight gradient stays in its backward (delayed
      wgrad moves the expert wgrad inside the paired layer step). Numerics are Megatron-Core's plain 1F1B's.
    * What it does not run is refused before the first step, one line per problem with its fix.
"""

import contextlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules
from megatron.core.pipeline_parallel.utils import ScheduleNode, get_comp_stream, set_streams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_attr_wrapped_model, get_model_config

from megatron.bridge.training.ep_overlap.mcore.agreement import announced
from megatron.bridge.training.ep_overlap.mcore.dualpipev_chunks import (  # noqa: F401 (callers import them from here)
    copies_summed_before_scaling,
    dualpipev_chunks,
    dualpipev_embedding_ranks,
    embedding_group_problem,
    pipeline_layout_problems,
)
from megatron.bridge.training.ep_overlap.program.dualpipev import dualpipev_problem, dualpipev_schedule, stage_of
from megatron.bridge.training.ep_overlap.program.pipeline import BACKWARD, FORWARD, PipelineStep, Transfer
from megatron.bridge.utils.process_groups import refuse_together, wait_work

# The model config field that selects this schedule in ``get_forward_backward_func``.
PIPELINE_SCHEDULE = "ep_overlap_pipeline_schedule"
P2P_TIMEOUT = timedelta(minutes=10)


def dualpipev_requested(model) -> bool:
    models = model if isinstance(model, (list, tuple)) else [model]
    return bool(models) and getattr(get_model_config(models[0]), PIPELINE_SCHEDULE, None) == "dualpipev"


def dualpipev_problems(models: list, num_microbatches: int) -> list[str]:
    """What :func:`forward_backward_dualpipev` cannot run, one line each with its fix."""
    P, r = parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_rank()
    problems = [p for p in [dualpipev_problem(P, num_microbatches)] if p]
    if len(models) != 2:
        return problems + [
            f"DualPipeV runs two model chunks per pipeline rank (stages r and 2P-1-r), got {len(models)}; fix: build "
            "the rank's chunks for those stages (pre_process on stage 0, post_process on stage 2P-1)"
        ]
    config = get_model_config(models[0])
    problems += pipeline_layout_problems(config, P)
    for v, chunk in enumerate(models):
        chunk = get_attr_wrapped_model(chunk, "pre_process", return_model_obj=True)
        stage = stage_of(r, v, P)
        if getattr(chunk, "dualpipev_stage", None) != stage:
            problems.append(
                f"model[{v}] of pipeline rank {r} was not built as DualPipeV's stage {stage} (Bridge's own model "
                "build makes the interleaved layout's chunks); fix: build the rank's chunks with megatron.bridge."
                "training.ep_overlap.mcore.dualpipev.dualpipev_chunks"
            )
        if (chunk.pre_process, chunk.post_process) != (stage == 0, stage == 2 * P - 1):
            problems.append(
                f"model[{v}] of pipeline rank {r} is DualPipeV's stage {stage}, but has pre_process="
                f"{chunk.pre_process}, post_process={chunk.post_process}; fix: build stage {stage} with pre_process="
                f"{stage == 0}, post_process={stage == 2 * P - 1}"
            )
    tied = getattr(models[-1], "share_embeddings_and_output_weights", False)
    if tied and not config.mtp_num_layers:
        problems += [p for p in [embedding_group_problem(r, "share_embeddings_and_output_weights=True")] if p]
    if config.mtp_num_layers:
        problems += [p for p in [embedding_group_problem(r, f"mtp_num_layers={config.mtp_num_layers}")] if p]
    fields = {
        "variable_seq_lengths": config.variable_seq_lengths,
        "enable_autocast": config.enable_autocast,
        # Megatron-Core's offload manager pairs each backward with the chunk of the last forward it saw; the V's
        # backward of one chunk beside the forward of the other breaks that pairing (its "Chunk mismatch" assert).
        "fine_grained_activation_offloading": getattr(config, "fine_grained_activation_offloading", False),
    }
    problems += [
        f"DualPipeV does not run {name}={value} yet; fix: unset it or use the 1F1B schedule ({PIPELINE_SCHEDULE}=None)"
        for name, value in fields.items()
        if value
    ]
    problems += [
        f"DualPipeV does not call config.{name} yet (DDP's overlapped {what}); fix: set the DDP config's "
        f"{flag}=False, or use the 1F1B schedule"
        for name, what, flag in (
            ("grad_sync_func", "grad reduce", "overlap_grad_reduce"),
            ("param_sync_func", "param gather", "overlap_param_gather"),
        )
        if getattr(config, name) is not None
    ]
    if P > 1 and dist.get_backend(parallel_state.get_pipeline_model_parallel_group()) != "gloo":
        problems.append(
            "DualPipeV's P2P needs a gloo pipeline group (tagged messages; NCCL matches by order, not built); fix: "
            "use the 1F1B or interleaved schedule"
        )
    return problems


_AGREED: set[tuple] = set()  # (the chunks' ids, N) every rank has accepted: one host all-gather each, not per step


def _refuse_together_once(models: list, num_microbatches: int, problems: list[str]) -> None:
    """A refusal on any rank is every rank's (a rank's chunks may be wrong where another's pass, as Bridge's own
    interleaved build passes on the middle ranks): none would wait in a P2P for a peer that stopped."""
    key = (tuple(id(m) for m in models), num_microbatches)
    if key in _AGREED and not problems:
        return
    refuse_together(ValueError("\n".join(problems)) if problems else None)
    _AGREED.add(key)


def forward_backward_dualpipev(
    *,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    p2p_log: list | None = None,
    **unused,
):
    """Megatron-Core's schedule arguments and result (see the module docstring); ``p2p_log``, where given, gets
    each P2P transfer as posted: ``("recv" | "send", Transfer)``."""
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    _refuse_together_once(models, num_microbatches, dualpipev_problems(models, num_microbatches))
    config = get_model_config(models[0])
    iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator] * 2
    run = _DualPipeV(forward_step_func, iterators, models, num_microbatches, config, collect_non_loss_data)
    shape = [seq_length // parallel_state.get_context_parallel_world_size(), micro_batch_size, config.hidden_size]
    if config.sequence_parallel:
        shape[0] //= parallel_state.get_tensor_model_parallel_world_size()
    run.shape = shape
    overlap = config.overlap_moe_expert_parallel_comm and not forward_only
    steps = dualpipev_schedule(run.P, num_microbatches, run.rank, overlap=overlap)
    if forward_only:  # the forwards alone, in the same order: no receive waits for a backward
        steps = [s for s in steps if s.forward is not None]
        steps = [PipelineStep(s.phase, s.forward, None, *_forward_only(s)) for s in steps]
    if overlap:
        set_streams(high_priority=config.high_priority_a2a_comm_stream)
    no_sync = config.no_sync_func or contextlib.nullcontext
    with announced(num_microbatches, early_backwards=True) if overlap else contextlib.nullcontext(), no_sync():
        for step in steps:
            run.step(step, overlap)
    run.finish()
    if p2p_log is not None:
        p2p_log.extend(run.p2p_log)
    if config.finalize_model_grads_func is not None and not forward_only:
        if config.calculate_per_token_loss:  # it broadcasts the count from the last pipeline rank; the V's is rank 0
            dist.all_reduce(run.num_tokens, group=run.group)
        with copies_summed_before_scaling(models) if run.rank == 0 else contextlib.nullcontext():
            config.finalize_model_grads_func(
                models,
                run.num_tokens if config.calculate_per_token_loss else None,
                pg_collection=unused.get("pg_collection") or ProcessGroupCollection.use_mpu_process_groups(),
                force_all_reduce=unused.get("force_all_reduce", False),
            )  # as Megatron-Core's schedules call it
    return run.store


def _forward_only(step: PipelineStep) -> tuple[tuple[Transfer, ...], tuple[Transfer, ...]]:
    return tuple(t for t in step.recv if t.kind == FORWARD), tuple(t for t in step.send if t.kind == FORWARD)


@dataclass
class _Held:
    """A forward kept for its backward: the chunk's input, its output (the loss on stage 2P-1), and with the
    overlap its plan and loss node."""

    input: torch.Tensor | None
    output: torch.Tensor
    plan: object = None
    loss_node: object = None


class _DualPipeV:
    """One training step of one rank: the held forwards, the P2P in flight, the local hand-offs of the last rank."""

    def __init__(self, forward_step_func, iterators, models, num_microbatches, config, collect_non_loss_data):
        self.forward_step_func, self.iterators, self.models = forward_step_func, iterators, models
        self.N, self.config, self.collect_non_loss_data = num_microbatches, config, collect_non_loss_data
        self.P = parallel_state.get_pipeline_model_parallel_world_size()
        self.rank = parallel_state.get_pipeline_model_parallel_rank()
        self.group = parallel_state.get_pipeline_model_parallel_group()
        self.store, self.held, self.local = [], {}, {}
        self.sends, self.p2p_log = [], []  # p2p_log: ("recv" | "send", Transfer) as posted
        self.num_tokens = torch.zeros([], dtype=torch.int)
        self.shape = None

    def _last(self, virtual: int) -> bool:
        return stage_of(self.rank, virtual, self.P) == 2 * self.P - 1

    def _receive(self, transfers) -> dict:
        works = {}
        for t in transfers:
            buffer = torch.empty(self.shape, dtype=self.config.pipeline_dtype)  # gloo: staged through the host
            peer = dist.get_global_rank(self.group, t.peer)
            works[t] = (dist.irecv(buffer, src=peer, group=self.group, tag=t.tag(2 * self.P)), buffer)
            self.p2p_log.append(("recv", t))
        received = {}
        for t, (work, buffer) in works.items():
            what = "activation" if t.kind == FORWARD else "gradient"
            op = f"DualPipeV receive of the {what} of microbatch {t.microbatch}, stage {t.chunk} from rank {t.peer}"
            wait_work(work, op=op, timeout=P2P_TIMEOUT, polled=False)
            received[t.kind] = buffer.to(_device(self.models[0]))
        return received

    def _send(self, transfers, kind: str, tensor: torch.Tensor | None) -> None:
        for t in (t for t in transfers if t.kind == kind):
            payload = tensor.detach().to("cpu").contiguous()
            peer = dist.get_global_rank(self.group, t.peer)
            self.sends.append((dist.isend(payload, dst=peer, group=self.group, tag=t.tag(2 * self.P)), payload))
            self.p2p_log.append(("send", t))

    def step(self, step: PipelineStep, overlap: bool) -> None:
        if step.weight is not None:
            return  # see the module docstring: the weight gradients ran in their backward
        received = self._receive(step.recv)
        f_input = self._forward_input(step.forward, received) if step.forward else None
        b_grad = self._output_grad(step.backward, received) if step.backward else None
        if overlap:
            output, input_grad = self._combined(step.forward, f_input, step.backward, b_grad)
        else:
            output = self._forward(step.forward, f_input) if step.forward else None
            input_grad = self._backward(step.backward, b_grad) if step.backward else None
        if step.forward is not None:
            self._hand_on(FORWARD, step.forward, output, step.send)
            if not overlap:  # Megatron-Core's pseudo-free: the backward reads only the output's grad_fn
                schedules.deallocate_output_tensor(output, self.config.deallocate_pipeline_outputs)
        if step.backward is not None:
            self._hand_on(BACKWARD, step.backward, input_grad, step.send)

    def _forward_input(self, unit, received):
        m, v = unit
        stage = stage_of(self.rank, v, self.P)
        if stage == 0:
            return None
        if stage == self.P:  # stage P-1 on this rank
            return self.local.pop((FORWARD, m)).detach().requires_grad_()
        return received[FORWARD].requires_grad_()

    def _output_grad(self, unit, received):
        m, v = unit
        stage = stage_of(self.rank, v, self.P)
        if stage == 2 * self.P - 1:
            return None
        if stage == self.P - 1:  # stage P on this rank
            return self.local.pop((BACKWARD, m))
        return received[BACKWARD]

    def _hand_on(self, kind: str, unit, tensor, sends) -> None:
        """Sends ``tensor`` where the op list says, or keeps it for the other chunk of the last rank."""
        m, v = unit
        stage = stage_of(self.rank, v, self.P)
        if kind == FORWARD and stage == self.P - 1:  # detached: a pseudo-free swaps the output's storage only
            self.local[FORWARD, m] = tensor.detach()
        elif kind != FORWARD and stage == self.P:
            self.local[BACKWARD, m] = tensor
        else:
            self._send(sends, kind, tensor)

    def _forward(self, unit, input_tensor):
        m, v = unit
        output, num_tokens = schedules.forward_step(
            self.forward_step_func, self.iterators[v], self.models[v], self.N, input_tensor, self.store, self.config,
            parallel_state.get_context_parallel_world_size(), self.collect_non_loss_data, None,
            is_first_microbatch=m == 0, current_microbatch=m, vp_stage=None, is_last_stage=self._last(v),
        )  # fmt: skip
        self.num_tokens += num_tokens
        self.held[unit] = _Held(input_tensor, output)
        return output

    def _backward(self, unit, output_grad):
        held = self.held.pop(unit)
        return schedules.backward_step(held.input, held.output, output_grad, self.config)

    def _combined(self, f_unit, f_input, b_unit, b_grad):
        """One call of the plan's ``run``: the forward of one chunk beside the backward of the other."""
        f_plan = loss_func = b_plan = b_held = None
        if f_unit is not None:
            m, v = f_unit
            chunk = self.models[v]
            schedules.set_current_microbatch(chunk, m)
            get_attr_wrapped_model(chunk, "set_input_tensor")([f_input])
            unwrapped = get_attr_wrapped_model(chunk, "build_schedule_plan", return_model_obj=True)
            f_plan, loss_func = self.forward_step_func(self.iterators[v], unwrapped, return_schedule_plan=True)
        if b_unit is not None:
            b_held = self.held.pop(b_unit)
            if b_held.input is not None:
                b_held.input.retain_grad()
            if b_grad is None:  # the loss's own backward, as Megatron-Core's combined step runs it
                loss = b_held.output
                loss = self.config.grad_scale_func(loss) if self.config.grad_scale_func is not None else loss
                torch.autograd.backward(loss)
                b_grad = b_held.loss_node.get_grad()
                b_held.loss_node._release_state()
            b_plan = b_held.plan
        output = type(f_plan or b_plan).run(f_plan, b_plan, b_grad=b_grad)
        input_grad = b_held.input.grad if b_held is not None and b_held.input is not None else None
        if f_unit is None:
            return None, input_grad
        loss_node = ScheduleNode(loss_func, get_comp_stream, f_plan.event, name="loss_func")
        output, num_tokens = schedules.forward_step_calc_loss(
            chunk, output, loss_node.forward, self.config, None, self.collect_non_loss_data, self.N, self.store,
            cp_group_size=parallel_state.get_context_parallel_world_size(), is_last_stage=self._last(v),
        )  # fmt: skip
        self.num_tokens += num_tokens
        self.held[f_unit] = _Held(f_input, output, f_plan, loss_node)
        return output, input_grad

    def finish(self) -> None:
        for work, _ in self.sends:
            wait_work(work, op="DualPipeV send", timeout=P2P_TIMEOUT, polled=False)
        self.sends.clear()


def _device(model) -> torch.device:
    return next(model.parameters()).device
