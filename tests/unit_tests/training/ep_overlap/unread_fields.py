"""The ``TransformerConfig`` fields Megatron-Core reads during a training step that this project's plan does not, each
with the reason it need not (the field audit; the reference model's READ/ELSEWHERE/DERIVED table is its twin).

Contract:
    * ``tests/unit_tests/training/ep_overlap/test_config_fields.py`` records every field each path reads in one step:
      Megatron-Core's driver with overlap off (the plain path), with its own schedule plan, with this project's plan
      (the hook), and this project's engine. A field the plain path reads (and Megatron-Core's own plan, for a
      ``GPTModel``) that the hook does not must be in :data:`NOT_READ_BY_THE_PLAN`; one the engine does not, in that
      table or :data:`NOT_READ_BY_THE_ENGINE`. Anything else fails the test.
    * A field the plan would need and cannot act on is refused by name when the plan is built (the rules in
      ``moe_overlap_rules``, or ``McoreChunk``), never listed here.
    * The audit's cases include Megatron-Bridge 0.6.2's newer families (GLM-5's DSA layers, Nemotron-3's latent MoE,
      K-EXAONE's and MiniMax-M3's layers); none needs a row here. Their features that are not Megatron-Core 0.19
      fields (DeepSeek-V4's hyper-connections and hash routing) are refused by rules (``model_features``). A case the
      engine refuses at a step's start (DSA: Megatron-Core's driver scales its indexer loss) is audited for the plan.
"""

NOT_READ_BY_THE_PLAN: dict[str, str] = {
    "config_logger_dir": "GPTModel.forward dumps its inputs there for debugging; the plan runs the model's parts, "
    "not its forward, so nothing is dumped, and nothing is computed with it",
    # Read by Megatron-Core's non-overlapped driver and stack forward only; its combined-1F1B driver (which runs any
    # schedule plan, Megatron-Core's own or this project's) reads them in neither place.
    "recompute_granularity": "the stack's forward reads it to pick its checkpointed path; the plan reads it when it "
    "is built (its full-recompute segments, ep_overlap/contract.py)",
    "cpu_offloading": "the stack's forward reads it for its offload context; the plan refuses it when it is built "
    "(rule activation_offloading)",
    "deallocate_pipeline_outputs": "the non-overlapped driver frees pipeline outputs with it; no pipeline here",
    "hybrid_context_parallel": "the non-overlapped driver's hybrid context-parallel schedule; off with the overlap",
    "pipeline_model_parallel_size": "the non-overlapped driver reads it per step; the plan's pipeline layout is "
    "checked when it is built",
}

NOT_READ_BY_THE_ENGINE: dict[str, str] = {
    "finalize_model_grads_func": "the engine sums gradients itself (engine/grads.py) and moves router biases "
    "(step_hooks.McoreStepHooks.update_router_biases) where Megatron-Core's finalize_model_grads would",
    "no_sync_func": "Megatron-Core's DDP defers its gradient reduction with it; the engine reduces once per step",
    "timers": "Megatron's timers; the engine records its own (engine/records.py)",
    "overlap_moe_expert_parallel_comm": "the engine takes overlap from its options (EPOverlapOptions.from_config "
    "reads it when the engine is built)",
    "fine_grained_activation_offloading": "refused at each engine step (step_hooks.step_problems): the engine never "
    "makes the offload manager's chunk handlers; under Megatron-Core's driver the plan does (mcore/offloading.py)",
    "moe_paged_stash": "refused at each engine step (step_hooks.step_problems): the engine never starts a paged-stash "
    "step (paged_stash_reset); under Megatron-Core's driver the plan runs it",
}
