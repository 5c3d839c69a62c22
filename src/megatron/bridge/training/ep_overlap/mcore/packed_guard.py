"""A packed microbatch must not train unpacked: stock Megatron-Bridge 0.6.2's forward step drops its parameters.

0.6.2's ``gpt_step._forward_step_common`` calls ``model.build_schedule_plan`` without ``packed_seq_params``;
:func:`dropped_packed_sequence` flags such a microbatch (trade-offs: ``docs/training/install.md``). Its check reads the
position ids, on a GPU a device synchronization: :class:`PackedGuard` makes it only for a plan builder's first
microbatches of each position-ids shape (a packed dataset packs every microbatch), none in later steps.
"""

import torch

from megatron.bridge.training.ep_overlap.mcore.agreement import step_microbatches


class _NotGiven:
    """The plan builder's ``packed_seq_params`` when its caller did not pass the keyword."""

    def __repr__(self) -> str:
        return "<packed_seq_params not given>"


NOT_GIVEN = _NotGiven()

DROPPED = (
    "packed_seq_params: this microbatch's position ids restart inside a row, as a packed microbatch's do, and "
    "build_schedule_plan was not given its packed-sequence parameters: Megatron-Bridge's gpt_step forward step "
    "(0.6.2, unpatched) passes a packed microbatch's document boundaries to the plain forward but not to "
    "build_schedule_plan, so with overlap each document would attend to the documents packed before it; fix: apply "
    "this project's patch (tools/upstream.py patch: its gpt_step hunk passes them), or turn "
    "overlap_moe_expert_parallel_comm off for packed data (data with reset position ids and no attention mask is not "
    "packed but looks the same: its forward step passes build_schedule_plan packed_seq_params=None, or the mask)"
)


def restarts_inside_a_row(position_ids: torch.Tensor) -> bool:
    """Whether some position id of a ``[B, S]`` tensor is not greater than the one before it in its row."""
    return bool((position_ids[:, 1:] <= position_ids[:, :-1]).any())


def dropped_packed_sequence(packed_seq_params, position_ids, attention_mask) -> bool:
    """True when the microbatch looks packed and its caller did not pass ``packed_seq_params`` (:data:`NOT_GIVEN`)."""
    if packed_seq_params is not NOT_GIVEN or attention_mask is not None:
        return False
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[1] < 2:
        return False
    if position_ids.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return restarts_inside_a_row(position_ids)


class PackedGuard:
    """One plan builder's :func:`dropped_packed_sequence`, checked for the first microbatches of each position-ids
    shape, as many as a step has (1 where the count is unknown), never after: no device read in later steps."""

    def __init__(self):
        self.reads_left: dict[tuple, int] = {}  # position-ids (shape, dtype, device) -> microbatches still checked

    def dropped(self, packed_seq_params, position_ids, attention_mask) -> bool:
        if packed_seq_params is not NOT_GIVEN or attention_mask is not None:
            return False  # decided on the host: no read
        if not isinstance(position_ids, torch.Tensor):
            return dropped_packed_sequence(packed_seq_params, position_ids, attention_mask)
        key = (tuple(position_ids.shape), position_ids.dtype, position_ids.device)
        if key not in self.reads_left:
            self.reads_left[key] = step_microbatches()[0] or 1
        left = self.reads_left[key]
        if left <= 0:
            return False
        self.reads_left[key] = left - 1
        return dropped_packed_sequence(packed_seq_params, position_ids, attention_mask)


def packed_problems(plan, packed_seq_params, input_ids) -> list[str]:
    """Why the plan cannot run this packed microbatch (it runs THD only); empty when it can."""
    problems = []
    layout = getattr(packed_seq_params, "qkv_format", None)
    if layout != "thd":
        problems.append(
            f"packed_seq_params: qkv_format={layout!r}: the plan runs packed microbatches in the THD layout; fix: "
            "pass qkv_format='thd' (what Megatron-Bridge's get_packed_seq_params builds)"
        )
    if input_ids is not None and input_ids.shape[0] != 1:
        problems.append(
            f"packed_seq_params: input_ids of {input_ids.shape[0]} rows: a packed (THD) microbatch is one row of "
            "concatenated documents; fix: micro_batch_size=1 with packed sequences"
        )
    if getattr(plan.config, "context_parallel_size", 1) > 1:
        problems.append(
            "packed_seq_params with context_parallel_size > 1: the plan does not partition packed rows across "
            "context-parallel ranks; fix: context_parallel_size=1, or turn overlap_moe_expert_parallel_comm off"
        )
    return problems
