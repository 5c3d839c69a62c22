"""Data-parallel wrappers this project's plan cannot drive under Megatron-Core's combined-1F1B driver.

Megatron-FSDP runs at PP 1: Megatron-Core's no-pipelining driver makes the wrapper's calls around each step and sets
each layer's reshard hooks on the plan's layer nodes (``EPOverlapSchedulePlan.get_layer``). With a pipeline, neither
driver makes them: Megatron-Core's interleaved one asserts on FSDP, and this project's plain 1F1B pipeline has none.
An MTP layer is refused too: the plan gives its embedding call aliases of the weights, unknown to FSDP's hooks.
"""

from megatron.bridge.training.moe_overlap_rules.facts import MEGATRON_FSDP, Rule, bridge_schedule

PIPELINE = "model.pipeline_model_parallel_size"
MTP = "model.mtp_num_layers"

DATA_PARALLEL_RULES: tuple[Rule, ...] = (
    Rule(
        "megatron_fsdp",
        (MEGATRON_FSDP, PIPELINE),
        lambda f: bridge_schedule(f) and (f[PIPELINE] or 1) > 1,
        lambda f: not f[MEGATRON_FSDP],
        "Megatron-FSDP gathers and releases each layer's parameters through calls the pipeline drivers do not make "
        "(Megatron-Core's interleaved driver asserts on FSDP; this project's plain 1F1B pipeline has no FSDP calls), "
        "so with pipeline_model_parallel_size > 1 its first step would fail or keep every layer gathered.",
        "set ddp.use_megatron_fsdp=False (Megatron DDP, with use_distributed_optimizer=True to shard the optimizer), "
        "or pipeline_model_parallel_size=1 (the plan runs Megatron-FSDP there), or turn "
        "overlap_moe_expert_parallel_comm off.",
    ),
    Rule(
        "megatron_fsdp_mtp",
        (MEGATRON_FSDP, MTP),
        lambda f: bridge_schedule(f) and bool(f[MTP]),
        lambda f: not f[MEGATRON_FSDP],
        "the plan's multi-token prediction layer calls the embedding with per-microbatch aliases of its weights (so "
        "the two uses' gradients are summed as the plain path sums them), which Megatron-FSDP's parameter-gather "
        "hooks do not know: its first step would fail (a KeyError in the FSDP all-gather; no_shard, which gathers "
        "nothing, runs, but the rules do not read the sharding strategy).",
        "set ddp.use_megatron_fsdp=False (Megatron DDP, with use_distributed_optimizer=True to shard the optimizer), "
        "or mtp_num_layers=None, or drop the use_ep_overlap_schedule pre-wrap hook (Megatron-Core's own plan runs "
        "it), or turn overlap_moe_expert_parallel_comm off.",
    ),
)
