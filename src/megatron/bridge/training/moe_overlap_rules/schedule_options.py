"""This project's schedule options (``EPOverlapOptions``): the attention-wgrad window, off-host launches,
chunked unpaired phases."""

from megatron.bridge.training.ep_overlap.options import WGRAD_WINDOWS
from megatron.bridge.training.moe_overlap_rules.facts import (
    CHUNKS,
    EDGE_PAIRING,
    MICRO_BATCH,
    OFF_HOST,
    OVERLAP,
    WGRAD_WINDOW,
    Rule,
    chunked,
)

SCHEDULE_OPTION_RULES: tuple[Rule, ...] = (
    # --- this project's schedule options (EPOverlapOptions) ---
    Rule(
        "attention_wgrad_window",
        (WGRAD_WINDOW,),
        lambda f: True,
        lambda f: f[WGRAD_WINDOW] in (*WGRAD_WINDOWS, None),
        "the delayed attention wgrad goes to window 1 (beside B.combine backward) or 2 (beside F.dispatch).",
        "set attention_wgrad_window to 1, 2, or None (auto: the planner chooses).",
    ),
    Rule(
        "attention_wgrad_auto_pp1",
        (WGRAD_WINDOW, "model.pipeline_model_parallel_size"),
        lambda f: f[WGRAD_WINDOW] is None,
        lambda f: (f["model.pipeline_model_parallel_size"] or 1) == 1,
        "attention_wgrad_window=None (auto) needs PP = 1: the planner that chooses simulates PP = 1.",
        "set attention_wgrad_window to 1 or 2 with pipeline parallelism.",
    ),
    Rule(
        "launch_off_host_needs_overlap",
        (OFF_HOST, OVERLAP),
        lambda f: f[OFF_HOST] is True,
        lambda f: f[OVERLAP],
        "launch_off_host launches the overlapped schedule's all-to-alls, and overlap is off.",
        "leave launch_off_host None (where it applies) or False, or turn overlap on.",
    ),
    Rule(
        "chunks_choice",
        (CHUNKS,),
        lambda f: True,
        lambda f: f[CHUNKS] in (1, 2),
        "moe_ep_overlap_chunks must be 1 (off) or 2 (split each microbatch that would run alone in two).",
        "set moe_ep_overlap_chunks to 1 or 2.",
    ),
    Rule(
        "chunks_need_overlap",
        (CHUNKS, OVERLAP),
        chunked,
        lambda f: f[OVERLAP],
        "chunking splits the phases the EP-overlap schedule leaves unpaired, so it needs that schedule.",
        "turn on overlap_moe_expert_parallel_comm, or set moe_ep_overlap_chunks=1.",
    ),
    Rule(
        "chunks_pp1",
        (CHUNKS, "model.pipeline_model_parallel_size"),
        chunked,
        lambda f: (f["model.pipeline_model_parallel_size"] or 1) == 1,
        "chunked unpaired phases are built for PP = 1 only.",
        "set moe_ep_overlap_chunks=1 with pipeline parallelism.",
    ),
    Rule(
        "chunks_or_edge_pairing",
        (CHUNKS, EDGE_PAIRING),
        chunked,
        lambda f: not f[EDGE_PAIRING],
        "edge pairing and chunking both pair the step's ends; they cannot both be on.",
        "choose one: edge_pairing=False or moe_ep_overlap_chunks=1.",
    ),
    Rule(
        "chunks_aux_loss",
        (CHUNKS, "model.moe_aux_loss_coeff"),
        chunked,
        lambda f: not (f["model.moe_aux_loss_coeff"] or 0.0) > 0,
        "a load-balancing loss over half a microbatch is a different loss than over the whole one.",
        "set moe_aux_loss_coeff=0, or moe_ep_overlap_chunks=1.",
    ),
    Rule(
        "chunks_z_loss",
        (CHUNKS, "model.moe_z_loss_coeff"),
        chunked,
        lambda f: not (f["model.moe_z_loss_coeff"] or 0.0) > 0,
        "the router z-loss is a mean over the microbatch's tokens; over half of them it is a different loss.",
        "unset moe_z_loss_coeff, or set moe_ep_overlap_chunks=1.",
    ),
    Rule(
        "chunks_capacity",
        (CHUNKS, "model.moe_expert_capacity_factor"),
        chunked,
        lambda f: f["model.moe_expert_capacity_factor"] is None,
        "which tokens a capacity drops depends on the whole microbatch.",
        "unset moe_expert_capacity_factor (no token dropping), or set moe_ep_overlap_chunks=1.",
    ),
    Rule(
        "chunks_micro_batch",
        (CHUNKS, MICRO_BATCH),
        lambda f: chunked(f) and f[MICRO_BATCH] is not None,
        lambda f: f[MICRO_BATCH] >= 2,
        "chunks split a microbatch along its sequences, so it needs at least 2.",
        "set micro_batch_size >= 2 (e.g. 2 sequences of half the length keep the tokens per microbatch), or "
        "moe_ep_overlap_chunks=1.",
    ),
)
