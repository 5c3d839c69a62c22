"""Data-parallel wrappers this project's plan cannot drive under Megatron-Core's combined-1F1B driver."""

from megatron.bridge.training.moe_overlap_rules.facts import MEGATRON_FSDP, Rule, bridge_schedule

DATA_PARALLEL_RULES: tuple[Rule, ...] = (
    Rule(
        "megatron_fsdp",
        (MEGATRON_FSDP,),
        bridge_schedule,
        lambda f: not f[MEGATRON_FSDP],
        "Megatron-FSDP gathers and releases each layer's parameters through per-layer hooks that Megatron-Core's "
        "combined-1F1B driver sets on its own plan's layers (num_layers, get_layer, set_fsdp_reshard_hooks); this "
        "project's plan has no such layers, so its first step would fail.",
        "set ddp.use_megatron_fsdp=False (Megatron DDP, with use_distributed_optimizer=True to shard the optimizer), "
        "or drop the use_ep_overlap_schedule pre-wrap hook (Megatron-Core's own plan runs it), or turn "
        "overlap_moe_expert_parallel_comm off.",
    ),
)
