"""The rules a configuration must satisfy for MoE expert-parallel (EP) communication overlap.

Contract:
    * Every rule is one row of data in ``MOE_OVERLAP_RULES``: a name, the fields it reads, when it applies,
      what must hold, what is wrong when it does not, and how to fix it. The rows live in one module per topic
      (``overlap``, ``recompute``, ``cuda_graphs``, ``quantization``, ``model_features``, ``architectures``,
      ``delay_wgrad``, ``schedule_options``); the
      facts they read and what a rule is, in ``facts``.
    * :func:`check_moe_overlap` evaluates every rule and returns all violations; it never raises and never
      stops at the first failure. :class:`CommOverlapConfigError` carries all of them in one message, one
      line per violation, each naming the field(s), the value(s) seen and the fix.
    * Facts are read by attribute name, so a Megatron-Core ``TransformerConfig`` or any object with the same
      attribute names works. Installed versions come from package metadata (see
      :mod:`megatron.bridge.utils.versions`) unless the caller passes its own version checks; nothing imports
      CUDA code.
    * A ``CommOverlapConfig``'s own fields (types, ranges, values set explicitly elsewhere) are checked in
      ``comm_overlap_values.py``, not here.
    * The error is both a ``ValueError`` and an ``AssertionError`` (what Megatron-Bridge's asserts raised), and
      each rule's message contains the phrase of Megatron-Bridge's assert for the same rule, so code that
      catches or matches upstream's errors keeps working.

Two rules depend on what runs the layers, not on the config alone:
    * The bf16/fp16 rule belongs to Megatron-Core's own combined-1F1B schedule (its ``TransformerConfig`` asserts
      it). This project's schedule (``ep_overlap_schedule = "bridge"`` on the model config; the reference model
      and the Megatron-Core plan set it) is bitwise-tested in fp32 too.
    * Transformer Engine version rules for delayed wgrad apply only when expert grouped GEMMs run through
      Transformer Engine. Our pure-torch grouped GEMM has no Transformer Engine requirement.
"""

from collections.abc import Callable, Iterable
from typing import Any

from megatron.bridge.training.moe_overlap_rules.architectures import ARCHITECTURE_RULES
from megatron.bridge.training.moe_overlap_rules.cuda_graphs import CUDA_GRAPH_RULES
from megatron.bridge.training.moe_overlap_rules.delay_wgrad import DELAY_WGRAD_RULES
from megatron.bridge.training.moe_overlap_rules.facts import (
    DELAY_WGRAD,
    MCORE_FULL_RECOMPUTE,
    OVERLAP,
    SCHEDULE,
    TE_GROUPED_GEMM,
    TORCH_GROUPED_GEMM,
    CommOverlapConfigError,
    Rule,
    Violation,
    defers_mcore_checks,
    gather_facts,
    graph_modules,
    grouped_gemm_backend,
    schedule_of,
    use_bridge_schedule,
)
from megatron.bridge.training.moe_overlap_rules.model_features import MODEL_FEATURE_RULES
from megatron.bridge.training.moe_overlap_rules.overlap import OVERLAP_RULES
from megatron.bridge.training.moe_overlap_rules.quantization import QUANTIZATION_RULES
from megatron.bridge.training.moe_overlap_rules.recompute import RECOMPUTE_RULES
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
)

__all__ = [
    "DELAY_WGRAD",
    "MCORE_FULL_RECOMPUTE",
    "MOE_OVERLAP_RULES",
    "OVERLAP",
    "SCHEDULE",
    "TE_GROUPED_GEMM",
    "TORCH_GROUPED_GEMM",
    "CommOverlapConfigError",
    "Rule",
    "Violation",
    "check_moe_overlap",
    "defers_mcore_checks",
    "gather_facts",
    "graph_modules",
    "grouped_gemm_backend",
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
) -> list[Violation]:
    """Evaluates every rule and returns all violations (empty when the config is fine). Never raises.

    Args:
        model_config: Model config read by attribute name (e.g. a ``TransformerConfig``).
        overlap_moe_expert_parallel_comm: Resolved EP-overlap flag.
        delay_wgrad_compute: Resolved delayed-wgrad flag.
        overlap_grad_reduce: Resolved data-parallel grad-reduce overlap flag.
        torch_at_least: Minimum-version check for PyTorch (default: the installed version).
        te_at_least: Minimum-version check for Transformer Engine (default: the installed version).
        rules: The rule table; defaults to ``MOE_OVERLAP_RULES``.
        options: This project's schedule options (``EPOverlapOptions``); None: their defaults.
        micro_batch_size: Sequences per microbatch, when a launcher knows it.
        model_config_built: False where a recipe's config is set up, before Megatron-Bridge builds (and Megatron-Core
            validates) the model config.
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
    )
    return [rule.violation(facts) for rule in rules if rule.applies(facts) and not rule.holds(facts)]
