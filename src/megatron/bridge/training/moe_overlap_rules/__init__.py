"""The EP-overlap rule table (``MOE_OVERLAP_RULES``, one module per topic) and its checker.

:class:`CommOverlapConfigError` (a ``ValueError`` and an ``AssertionError``) lists violations one per line, each with
upstream's assert phrase for its rule.
"""

from collections.abc import Callable, Iterable
from typing import Any

from megatron.bridge.training.moe_overlap_rules.cuda_graphs import CUDA_GRAPH_RULES
from megatron.bridge.training.moe_overlap_rules.data_parallel import DATA_PARALLEL_RULES
from megatron.bridge.training.moe_overlap_rules.facts import (
    CommOverlapConfigError,
    Rule,
    Violation,
    defers_mcore_checks,
    gather_facts,
    graph_modules,
    schedule_of,
    use_bridge_schedule,
)
from megatron.bridge.training.moe_overlap_rules.model_features import ARCHITECTURE_RULES, MODEL_FEATURE_RULES
from megatron.bridge.training.moe_overlap_rules.overlap import DELAY_WGRAD_RULES, OVERLAP_RULES
from megatron.bridge.training.moe_overlap_rules.recompute import QUANTIZATION_RULES, RECOMPUTE_RULES
from megatron.bridge.training.moe_overlap_rules.schedule_options import SCHEDULE_OPTION_RULES

MOE_OVERLAP_RULES: tuple[Rule, ...] = (
    OVERLAP_RULES
    + RECOMPUTE_RULES
    + CUDA_GRAPH_RULES
    + QUANTIZATION_RULES
    + MODEL_FEATURE_RULES
    + ARCHITECTURE_RULES
    + DELAY_WGRAD_RULES
    + SCHEDULE_OPTION_RULES
    + DATA_PARALLEL_RULES
)

__all__ = [
    "MOE_OVERLAP_RULES",
    "CommOverlapConfigError",
    "Rule",
    "Violation",
    "check_moe_overlap",
    "defers_mcore_checks",
    "gather_facts",
    "graph_modules",
    "schedule_of",
    "use_bridge_schedule",
]


def check_moe_overlap(
    model_config: Any,
    *,
    overlap_moe_expert_parallel_comm: bool,
    delay_wgrad_compute: bool,
    overlap_grad_reduce: bool = False,
    torch_at_least: Callable[[str], bool] | None = None,
    te_at_least: Callable[[str], bool] | None = None,
    rules: Iterable[Rule] = MOE_OVERLAP_RULES,
    options: Any = None,
    micro_batch_size: int | None = None,
    model_config_built: bool = True,
    megatron_fsdp: bool = False,
) -> list[Violation]:
    """Evaluates every rule and returns all violations (empty when the config is fine). Never raises.

    ``model_config_built`` is False at a recipe's setup, before Megatron-Bridge builds the model config.
    """
    facts = gather_facts(
        model_config,
        overlap_moe_expert_parallel_comm=overlap_moe_expert_parallel_comm,
        delay_wgrad_compute=delay_wgrad_compute,
        overlap_grad_reduce=overlap_grad_reduce,
        torch_at_least=torch_at_least,
        te_at_least=te_at_least,
        options=options,
        micro_batch_size=micro_batch_size,
        model_config_built=model_config_built,
        megatron_fsdp=megatron_fsdp,
    )
    return [rule.violation(facts) for rule in rules if rule.applies(facts) and not rule.holds(facts)]
