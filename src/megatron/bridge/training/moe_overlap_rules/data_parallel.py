"""Data-parallel wrappers this project's plan cannot drive under Megatron-Core's combined-1F1B driver.

Megatron-FSDP runs at PP 1: Megatron-Core's no-pipelining driver makes the wrapper's calls around each step and sets
each layer's reshard hooks on the plan's layer nodes (``EPOverlapSchedulePlan.get_layer``). With a pipeline, neither
driver makes them: Megatron-Core's interleaved one asserts on FSDP, and this project's plain 1F1B pipeline has none.
An MTP layer runs: its embedding call swaps in aliases of the weights only inside FSDP's gather and release.
"""

from megatron.bridge.training.moe_overlap_rules.facts import MEGATRON_FSDP, Rule, bridge_schedule

PIPELINE = "model.pipeline_model_parallel_size"

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
)
