"""A packed microbatch must not train unpacked: stock Megatron-Bridge 0.6.2's forward step drops its parameters.

Megatron-Bridge 0.6.2's ``gpt_step._forward_step_common`` builds a packed microbatch's packed-sequence parameters (the
document boundaries, ``cu_seqlens``) for the plain forward only: it calls ``model.build_schedule_plan(tokens,
position_ids, attention_mask, labels=..., loss_mask=...)``, without them. A plan built from such a microbatch would run
one causal mask over the whole packed row, so every document would attend to the ones packed before it, silently.

Contract:
    * :func:`dropped_packed_sequence` decides from what the plan builder was given, and reads no other function's
      state. A microbatch's parameters were dropped when all three hold:

          - the caller did not pass ``packed_seq_params`` at all (:data:`NOT_GIVEN`): stock 0.6.2's call. This
            project's patched ``gpt_step`` always passes it (None for a padded microbatch), and so may a forward step
            of the recipe's own;
          - no attention mask (a mask, where one is given, says what attends to what);
          - position ids that restart inside a row: some id is not greater than the one before it. A packed
            dataset numbers each document's tokens from 0; a padded row counts up, and so do a context-parallel
            rank's load-balanced slices of one. A row whose ids count up is not refused, a packed row holding one
            document among them (no document is packed before it).

    * So padded data, the patched ``gpt_step`` and a forward step that passes the keyword never trip it, whatever
      their position ids; any forward step that drops a packed microbatch's parameters does, where its position ids
      are ``[batch, sequence]`` (0.6.2's ``vlm_step`` and ``llava_step`` call the builder as its ``gpt_step`` does).
    * The trade-offs, which the refusal names (``docs/training/install.md``): data with reset position ids and no
      attention mask (``reset_position_ids`` without ``reset_attention_mask``) looks the same, and is refused where
      the keyword is missing: its forward step passes ``packed_seq_params=None`` (or the mask), or the patch is
      applied. A stage given no position ids (Bridge gives a pipeline's last stage only labels and the loss mask,
      without MTP) cannot tell: the first stage refuses, and the launcher ends the run. Reading the
      position ids costs one device-to-host copy of one flag per microbatch, on the stages given them, and only
      where the keyword is missing; none while a CUDA graph is being captured (a copy to the host is not allowed
      there; the eager steps before the capture were checked).
"""

import torch


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
    """True when the plan builder's microbatch looks packed and its caller gave no ``packed_seq_params`` (see the
    module docstring: ``packed_seq_params`` is :data:`NOT_GIVEN` when the keyword was not passed)."""
    if packed_seq_params is not NOT_GIVEN or attention_mask is not None:
        return False
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[1] < 2:
        return False
    if position_ids.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return restarts_inside_a_row(position_ids)


def packed_problems(plan, packed_seq_params, input_ids) -> list[str]:
    """What keeps the plan from running this packed microbatch as the model's forward would (empty when it can):
    Megatron-Core packs THD microbatches into one row, and the plan runs them in that layout."""
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
