"""A packed microbatch must not train unpacked: stock Megatron-Bridge 0.6.2's forward step drops its parameters.

Megatron-Bridge 0.6.2's ``gpt_step._forward_step_common`` reads a microbatch's packed-sequence metadata (the document
boundaries, ``cu_seqlens``) into its local ``packed_seq_metadata`` and hands the parameters built from it to the plain
forward only; ``model.build_schedule_plan`` gets none of it. A plan built from such a microbatch would run one causal
mask over the whole packed row, so every document would attend to the ones packed before it, silently.

:func:`dropped_packed_sequence` looks at the frame that called the plan builder: when it is Megatron-Bridge's
``_forward_step_common`` and that call holds packed metadata while the builder got no ``packed_seq_params``, the
parameters were dropped. It reads what Bridge read from the batch, so a padded microbatch (no metadata), data with
reset position ids, a forward step of the recipe's own, or a patched ``gpt_step`` (which passes the parameters) can
never raise it.
"""

import sys

_FORWARD_STEP = "_forward_step_common"
_FRAMES_UP = 4  # the builder's caller, and a few frames above it for wrappers in between

DROPPED = (
    "packed_seq_params: Megatron-Bridge's gpt_step forward step (0.6.2, unpatched) passes this packed microbatch's "
    "document boundaries to the plain forward but not to build_schedule_plan, so with overlap each document would "
    "attend to the documents packed before it; fix: apply this project's patch (tools/upstream.py patch: its gpt_step "
    "hunk passes them), or turn overlap_moe_expert_parallel_comm off for packed data"
)


def dropped_packed_sequence(packed_seq_params, *, depth: int = 2) -> bool:
    """True when Megatron-Bridge's forward step, ``depth`` frames above this call or a few more, holds packed-sequence
    metadata for this microbatch and the plan builder was given no ``packed_seq_params``."""
    if packed_seq_params is not None:
        return False
    frame = sys._getframe(depth)
    for _ in range(_FRAMES_UP):
        if frame is None:
            return False
        if frame.f_code.co_name == _FORWARD_STEP and frame.f_globals.get("__name__", "").startswith("megatron.bridge"):
            return frame.f_locals.get("packed_seq_metadata") is not None
        frame = frame.f_back
    return False


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
