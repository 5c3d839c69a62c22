"""What the engine checks of a step's data before any layer runs and of its results after the backward, each with one
small all-reduce, so a problem on any rank fails every rank at once, naming the rank and the microbatch.

Before the step: the number of tokens that count in the loss (the loss normalizer), one "bad input" flag per rank,
and each rank's microbatch count, sequence length and token dtype, which every rank must agree on (their collectives
would not match otherwise, and a rank would wait out the collective timeout). After the backward (with
``check_for_nan_in_loss_and_grad``): per rank, the first microbatch whose loss is not finite and whether any
gradient is not.
"""

import torch

from ep_overlap_lab.collectives import all_reduce
from megatron.bridge.training.ep_overlap.contract import IGNORE_INDEX
from megatron.bridge.utils.process_groups import EPGroups

# (tokens [B, S], labels [B, S]), or with the packed-sequence parameters of a packed (THD) microbatch (B = 1)
Microbatch = tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, object]


TOKEN_DTYPES = {torch.int64: 1, torch.int32: 2}  # what an embedding takes, coded for the all-reduce
AGREED = ("microbatches per step", "sequence length", "token dtype")  # what the ranks must agree on


def _layout_problem(i: int, microbatch: Microbatch, sequence_length: int | None, split: set[int]) -> str | None:
    """The first thing wrong with microbatch ``i``'s shapes and dtypes (None when nothing is)."""
    tokens, labels, *packed = microbatch
    packed = packed[0] if packed else None
    if packed is not None and (tokens.dim() != 2 or tokens.shape[0] != 1):
        return (
            f"microbatch {i}: a packed (THD) microbatch is one row of concatenated documents, got tokens "
            f"{tuple(tokens.shape)}; fix: tokens and labels of shape [1, S]"
        )
    if packed is not None and getattr(packed, "qkv_format", None) != "thd":
        return (
            f"microbatch {i}: packed_seq_params with qkv_format={getattr(packed, 'qkv_format', None)!r}; "
            "fix: qkv_format='thd'"
        )
    if packed is not None and i in split:
        return (
            f"microbatch {i}: moe_ep_overlap_chunks=2 splits microbatches along the batch, and a packed one has "
            "one row; fix: set moe_ep_overlap_chunks=1"
        )
    if tokens.dim() != 2 or tokens.shape != labels.shape:
        return f"microbatch {i}: tokens {tuple(tokens.shape)} and labels {tuple(labels.shape)} must both be [B, S]"
    if sequence_length is not None and tokens.shape[1] != sequence_length:
        return (
            f"microbatch {i}: sequences of {tokens.shape[1]} tokens, but the model takes {sequence_length} (its "
            f"position embedding and attention mask); fix: give sequences of {sequence_length} tokens"
        )
    if i in split and tokens.shape[0] < 2:
        return (
            f"microbatch {i}: moe_ep_overlap_chunks=2 splits it in two along the batch, but it has "
            f"{tokens.shape[0]} sequence; fix: give it at least 2, or set moe_ep_overlap_chunks=1"
        )
    if tokens.dtype not in TOKEN_DTYPES or labels.dtype != torch.int64:
        return (
            f"microbatch {i}: tokens must be int64 or int32 ids and labels int64, not {tokens.dtype}/"
            f"{labels.dtype}; fix: convert them, e.g. tokens.long()"
        )
    return None


def _microbatch_problems(
    microbatches: list[Microbatch], vocab_size: int, sequence_length: int | None, split: set[int]
) -> list[str]:
    """What is wrong with this rank's microbatches (empty when nothing is), each naming the microbatch; those in
    ``split`` are chunked and need two sequences or more."""
    problems = []
    flags = []
    for i, microbatch in enumerate(microbatches):
        problem = _layout_problem(i, microbatch, sequence_length, split)
        if problem is not None:
            problems.append(problem)
            continue
        tokens, labels = microbatch[:2]
        bad_tokens = ((tokens < 0) | (tokens >= vocab_size)).any()
        bad_labels = (((labels < 0) & (labels != IGNORE_INDEX)) | (labels >= vocab_size)).any()
        flags.append((i, torch.stack([bad_tokens, bad_labels])))
    if flags:
        found = torch.stack([f for _, f in flags]).tolist()  # one host sync for every microbatch
        for (i, _), (bad_tokens, bad_labels) in zip(flags, found):
            tokens, labels = microbatches[i][:2]
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


def _rank_and_world() -> tuple[int, int]:
    initialized = torch.distributed.is_initialized()
    return (torch.distributed.get_rank(), torch.distributed.get_world_size()) if initialized else (0, 1)


def _shape(microbatches: list[Microbatch]) -> list[int]:
    """What the ranks must agree on (:data:`AGREED`), from this rank's microbatches."""
    tokens = microbatches[0][0]
    return [len(microbatches), tokens.shape[-1], TOKEN_DTYPES.get(tokens.dtype, 0)]


def loss_token_count(microbatches: list[Microbatch], chunks: list, split: set[int], groups: EPGroups, device) -> float:
    """Tokens that count in the loss, over every microbatch of every rank (``chunks``: this rank's; ``split``: the
    microbatches the program runs as two halves); refuses malformed input and ranks that disagree, everywhere.

    Raises:
        ValueError: On every rank, when any rank's microbatch has mismatched shapes, the wrong sequence length or
            dtype, or token ids/labels outside the vocabulary (the offending rank's message names the microbatch),
            or when the ranks disagree on what :data:`AGREED` lists (naming the ranks and their values).
    """
    rank, world = _rank_and_world()
    chunk = chunks[0]
    problems = _microbatch_problems(microbatches, chunk.vocab_size, chunk.sequence_length, split)
    problems = [f"rank {rank}: {p}" for p in problems]
    # [tokens that count, then per rank: a "bad input" flag and its shape]: one small collective for all of it.
    per_rank = 1 + len(AGREED)
    tally = torch.zeros(1 + world * per_rank, dtype=torch.float64, device=device)
    tally[1 + rank * per_rank : 1 + (rank + 1) * per_rank] = torch.tensor([bool(problems), *_shape(microbatches)])
    if not problems and chunks[-1].post_process:  # every pipeline stage has the data; one counts it
        tally[0] = torch.stack([(mb[1] != IGNORE_INDEX).sum() for mb in microbatches]).sum()
    if torch.distributed.is_initialized():
        all_reduce(tally, None, op="loss token count", timeout=groups.timeout)
    counted, *rest = tally.tolist()  # the step's one host sync for this
    table = [rest[r * per_rank : (r + 1) * per_rank] for r in range(world)]
    bad_ranks = [r for r, row in enumerate(table) if row[0] > 0]
    if bad_ranks:
        here = "; ".join(problems) if problems else "this rank's input is fine"
        raise ValueError(f"bad microbatch input on rank(s) {bad_ranks}: {here}")
    disagree = [
        f"{what}: " + ", ".join(f"rank {r} has {_show(what, row[1 + i])}" for r, row in enumerate(table))
        for i, what in enumerate(AGREED)
        if len({row[1 + i] for row in table}) > 1
    ]
    if disagree:
        raise ValueError(
            "the ranks disagree on the step's shape, so their collectives would not match: " + "; ".join(disagree)
        )
    if counted == 0:
        raise ValueError(f"every label of this step is IGNORE_INDEX ({IGNORE_INDEX}): there is no loss to train on")
    return counted


def _show(what: str, value: float) -> str:
    if what == "token dtype":
        return next((str(d) for d, code in TOKEN_DTYPES.items() if code == value), "another dtype")
    return str(int(value))


def check_finite(losses: list[torch.Tensor], params: list[tuple[str, torch.Tensor]], groups: EPGroups, device) -> None:
    """Refuses a step whose loss or gradient is not finite, on every rank at once (Megatron-Core's
    ``check_for_nan_in_loss_and_grad``). ``losses`` per microbatch (the last pipeline stage's), ``params`` the
    (name, gradient) pairs of this step's contribution.

    Raises:
        FloatingPointError: Naming every rank with a non-finite loss (and its first such microbatch) or gradient.
    """
    rank, world = _rank_and_world()
    checked = [*losses, *(g for _, g in params)]
    finite = torch.stack([torch.isfinite(t).all() for t in checked]).tolist() if checked else []  # one host sync
    bad_loss = next((i for i, ok in enumerate(finite[: len(losses)]) if not ok), None)
    bad_grad = next((name for (name, _), ok in zip(params, finite[len(losses) :]) if not ok), None)
    flags = torch.zeros(2 * world, dtype=torch.float64, device=device)
    flags[2 * rank] = 0 if bad_loss is None else bad_loss + 1
    flags[2 * rank + 1] = bad_grad is not None
    if torch.distributed.is_initialized():
        all_reduce(flags, None, op="non-finite check", timeout=groups.timeout)
    found = flags.tolist()
    lines = []
    for r in range(world):
        if found[2 * r]:
            lines.append(f"rank {r}: the loss of microbatch {int(found[2 * r]) - 1} is not finite")
        if found[2 * r + 1]:
            first = f" (first: {bad_grad})" if r == rank else ""
            lines.append(f"rank {r}: a gradient is not finite{first}")
    if lines:
        raise FloatingPointError("non-finite values in this step: " + "; ".join(lines))
