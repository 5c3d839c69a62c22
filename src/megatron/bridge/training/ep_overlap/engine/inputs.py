"""What the engine checks of a step's data before any layer runs, and the loss normalizer it derives from it.

One small all-reduce per step carries the number of tokens that count in the loss and one "bad input" flag per
rank, so a malformed microbatch on any rank fails every rank at once, naming the rank and the microbatch.
"""

import torch

from megatron.bridge.training.ep_overlap.contract import IGNORE_INDEX
from megatron.bridge.utils.process_groups import EPGroups, all_reduce

Microbatch = tuple[torch.Tensor, torch.Tensor]  # (tokens [B, S], labels [B, S])


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


def loss_token_count(microbatches: list[Microbatch], chunks: list, split: set[int], groups: EPGroups, device) -> float:
    """Tokens that count in the loss, over every microbatch of every rank (``chunks``: this rank's; ``split``: the
    microbatches the program runs as two halves); refuses malformed input everywhere.

    Raises:
        ValueError: On every rank, when any rank's microbatch has mismatched shapes, a non-integer dtype, or
            token ids/labels outside the vocabulary; the offending rank's message names the microbatch.
    """
    initialized = torch.distributed.is_initialized()
    rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if initialized else (0, 1)
    problems = [f"rank {rank}: {p}" for p in _microbatch_problems(microbatches, chunks[0].vocab_size, split)]
    # [tokens that count, then one "bad input" flag per rank]: one small collective for both.
    tally = torch.zeros(1 + world, dtype=torch.float64, device=device)
    if problems:
        tally[1 + rank] = 1
    elif chunks[-1].post_process:  # every pipeline stage has the data; one counts it
        tally[0] = torch.stack([(labels != IGNORE_INDEX).sum() for _, labels in microbatches]).sum()
    if initialized:
        all_reduce(tally, None, op="loss token count", timeout=groups.timeout)
    counted, *flags = tally.tolist()  # the step's one host sync for this
    bad_ranks = [r for r, flag in enumerate(flags) if flag > 0]
    if bad_ranks:
        here = "; ".join(problems) if problems else "this rank's input is fine"
        raise ValueError(f"bad microbatch input on rank(s) {bad_ranks}: {here}")
    if counted == 0:
        raise ValueError(f"every label of this step is IGNORE_INDEX ({IGNORE_INDEX}): there is no loss to train on")
    return counted
