"""A model's EP-overlap settings, resolved once: the schedule's options, full recompute's segments, the broken rules.

Contract:
    * :func:`resolve` turns a model config (read by attribute name: a Megatron-Core ``TransformerConfig``, the
      reference model's ``MoEGPTConfig``, or any object with the same attribute names) and the schedule's options
      into one frozen :class:`Settings`. It is the only place where these are derived: the options a model config
      implies (``overlap_moe_expert_parallel_comm``, ``delay_wgrad_compute``), the layers full recompute replays,
      and which EP-overlap rules the pair breaks (``moe_overlap_rules``). The engine, the Megatron-Core hook and
      plans, the reference model, the planner, the harness and ``CommOverlapConfig.setup`` all read them here.
    * An invalid setting is a violation (one line each, with its fix), never an empty result:
      :meth:`Settings.segments` refuses to cut a chunk by a full-recompute setting the rules refuse.
    * No torch here.
"""

from dataclasses import dataclass
from typing import Any

from megatron.bridge.training.ep_overlap.options import EPOverlapOptions
from megatron.bridge.training.moe_overlap_rules import CommOverlapConfigError, Violation, check_moe_overlap

# The rules that say whether full recompute names its segments (method and layer count).
_RECOMPUTE_RULES = ("full_recompute_method", "full_recompute_num_layers")


@dataclass(frozen=True)
class Settings:
    """What :func:`resolve` derived (see the module docstring).

    Attributes:
        options: The schedule's options.
        violations: Every broken rule, in the rules table's order.
        full_recompute: ``(recompute_method, recompute_num_layers)`` when the config asks for full recompute.
    """

    options: EPOverlapOptions
    violations: tuple[Violation, ...] = ()
    full_recompute: tuple[Any, Any] | None = None

    @property
    def delay_wgrad(self) -> bool:
        """Whether overlapped steps defer weight gradients (delayed wgrad runs only in the overlapped schedule)."""
        return self.options.overlap and self.options.delay_wgrad

    def checked(self) -> "Settings":
        """These settings, when no rule is broken.

        Raises:
            CommOverlapConfigError: Naming every violation, one line each.
        """
        if self.violations:
            raise CommOverlapConfigError(self.violations)
        return self

    def segments(self, num_units: int) -> tuple[tuple[int, int], ...]:
        """Full recompute's segments of a chunk of ``num_units`` units, as ``(first, stop)`` positions, in order:
        ``uniform`` cuts the chunk into segments of ``recompute_num_layers`` (the last may be shorter), ``block``
        recomputes the first ``recompute_num_layers`` units one by one; none without full recompute.

        Raises:
            CommOverlapConfigError: When the full-recompute fields name no segments.
        """
        if self.full_recompute is None:
            return ()
        broken = [v for v in self.violations if v.name in _RECOMPUTE_RULES]
        if broken:
            raise CommOverlapConfigError(broken)
        method, n = self.full_recompute
        if method == "uniform":
            return tuple((i, min(i + n, num_units)) for i in range(0, num_units, n))
        return tuple((i, i + 1) for i in range(min(n, num_units)))


def resolve(
    model_config: Any,
    options: EPOverlapOptions | None = None,
    *,
    overlap_grad_reduce: bool = False,
    micro_batch_size: int | None = None,
    torch_at_least=None,
    te_at_least=None,
    model_config_built: bool = True,
) -> Settings:
    """The settings of ``model_config`` run with ``options`` (None: the options the config implies, see
    :meth:`EPOverlapOptions.from_config`). The keywords are what a caller knows beyond the two:
    ``overlap_grad_reduce`` (the data-parallel overlap), ``micro_batch_size`` (a launcher's data), version checks
    (default: the installed versions) and whether Megatron-Core's own checks of the config already ran."""
    options = EPOverlapOptions.from_config(model_config) if options is None else options
    violations = check_moe_overlap(
        model_config,
        overlap_moe_expert_parallel_comm=options.overlap,
        delay_wgrad_compute=options.delay_wgrad,
        overlap_grad_reduce=overlap_grad_reduce,
        torch_at_least=torch_at_least,
        te_at_least=te_at_least,
        options=options,
        micro_batch_size=micro_batch_size,
        model_config_built=model_config_built,
    )
    full = None
    if getattr(model_config, "recompute_granularity", None) == "full":
        full = (getattr(model_config, "recompute_method", None), getattr(model_config, "recompute_num_layers", None))
    return Settings(options, tuple(violations), full)
