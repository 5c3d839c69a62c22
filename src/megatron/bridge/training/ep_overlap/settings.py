"""A model's EP-overlap settings, resolved once: the schedule's options and what they resolve to, full recompute's
segments, the token dispatcher's kind, the broken rules.

Contract:
    * :func:`resolve` turns a model config (read by attribute name: a Megatron-Core ``TransformerConfig``, the
      reference model's ``MoEGPTConfig``, or any object with the same attribute names) and the schedule's options
      into one frozen :class:`Settings`. It is the only place where these are derived: the options a model config
      implies (``overlap_moe_expert_parallel_comm``, ``delay_wgrad_compute``), the layers full recompute replays,
      and which EP-overlap rules the pair breaks (``moe_overlap_rules``). The engine, the Megatron-Core hook and
      plans, the reference model, the planner, the harness and ``CommOverlapConfig.setup`` all read them here.
    * What the options resolve to is read here, never re-derived by a consumer: :attr:`Settings.delay_wgrad`
      (delayed wgrad runs only in the overlapped schedule: overlap and delay), :attr:`Settings.attention_wgrad_window`
      (always 1 or 2, see there) with :attr:`Settings.wgrad_window_auto` (the planner is still to choose it: the
      options' None with delayed wgrad) and :meth:`Settings.placed` (where an automatic window becomes the chosen
      one, once: ``EPOverlapEngine``'s first training step), and :attr:`Settings.moe_layers_own_comm` (the flex
      dispatcher: MoE layers move their own tokens; else the schedule's comm lane does).
    * An invalid setting is a violation (one line each, with its fix), never an empty result:
      :meth:`Settings.segments` refuses to cut a chunk by a full-recompute setting the rules refuse. Which values
      are valid (the window's, the dispatcher's) is the rules' alone; the properties above assume valid settings.
    * Where a value is written: :func:`defer_overlap_flag` keeps the overlap flag (and delayed wgrad, which needs it)
      off a Megatron-Bridge model provider whose Megatron-Core checks would refuse it (the plain 1F1B pipeline:
      PP > 1 without virtual stages, under this project's schedule), noting them on the config.
      :func:`apply_deferred` sets them: this project's patch to Bridge's ``setup`` does it just before the model is
      built (so Transformer Engine's linears are built delaying their weight gradients), the hook on the built
      config otherwise (then nothing is delayed, and it says so once).
    * No torch here.
"""

import logging
from dataclasses import dataclass, replace
from typing import Any

from megatron.bridge.training.ep_overlap.options import WGRAD_WINDOWS, EPOverlapOptions
from megatron.bridge.training.moe_overlap_rules import (
    CommOverlapConfigError,
    Violation,
    check_moe_overlap,
    defers_mcore_checks,
    schedule_of,
)

logger = logging.getLogger(__name__)

# The rules that say whether full recompute names its segments (method and layer count).
_RECOMPUTE_RULES = ("full_recompute_method", "full_recompute_num_layers")
# A model config's note of the fields the hook sets once the config is built (Megatron-Core's checks refuse them).
DEFERRED = "ep_overlap_deferred"


@dataclass(frozen=True)
class Settings:
    """What :func:`resolve` derived (see the module docstring).

    Attributes:
        options: The schedule's options.
        violations: Every broken rule, in the rules table's order.
        full_recompute: ``(recompute_method, recompute_num_layers)`` when the config asks for full recompute.
        token_dispatcher: The model config's ``moe_token_dispatcher_type`` (the rules say which the overlap takes).
    """

    options: EPOverlapOptions
    violations: tuple[Violation, ...] = ()
    full_recompute: tuple[Any, Any] | None = None
    token_dispatcher: str | None = None

    @property
    def delay_wgrad(self) -> bool:
        """Whether overlapped steps defer weight gradients (delayed wgrad runs only in the overlapped schedule)."""
        return self.options.overlap and self.options.delay_wgrad

    @property
    def wgrad_window_auto(self) -> bool:
        """Whether the planner is still to choose the attention wgrad's window: delayed wgrad with the options'
        ``attention_wgrad_window=None`` (auto). ``EPOverlapEngine`` measures its first training step on the plain
        path, then :meth:`placed` fixes the window; an overlapped training step is refused until then. Without
        delayed wgrad there is nothing to place, so None is not auto."""
        return self.delay_wgrad and self.options.attention_wgrad_window is None

    @property
    def attention_wgrad_window(self) -> int:
        """The window (1 or 2) of the next layer step that runs a layer's delayed attention wgrad: the options'
        window where they give one. Where they give None: 1 without delayed wgrad (no step places an attention
        wgrad), and 1 while the planner is still to choose (:attr:`wgrad_window_auto`), which only the steps that
        place none run with (the measured plain step, forward-only steps)."""
        window = self.options.attention_wgrad_window
        return WGRAD_WINDOWS[0] if window is None else window

    @property
    def moe_layers_own_comm(self) -> bool:
        """Whether MoE layers move their own tokens: the ``flex`` dispatcher, whose backend fuses permute and
        all-to-all (a layer that ``owns_comm``). Otherwise (``alltoall``) the schedule's comm lane all-to-alls the
        tokens the dispatcher permuted, with its split sizes."""
        return self.token_dispatcher == "flex"

    def placed(self, window: int) -> "Settings":
        """These settings with the attention wgrad in ``window``, which the planner chose: where an automatic window
        becomes a number (once, ``EPOverlapEngine``).

        Raises:
            ValueError: When ``window`` is not one of ``WGRAD_WINDOWS``.
        """
        if window not in WGRAD_WINDOWS:
            raise ValueError(f"the planner chose attention wgrad window {window!r}, not one of {WGRAD_WINDOWS}")
        return replace(self, options=replace(self.options, attention_wgrad_window=window))

    def plain(self) -> "Settings":
        """These settings for one step on the plain path (overlap off, so nothing is delayed and there is no window
        to place): ``EPOverlapEngine``'s measured step. The violations stay these settings': the step belongs to
        this configuration (a configuration asking for delayed wgrad with overlap off is another one, refused)."""
        return replace(self, options=replace(self.options, overlap=False))

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
    dispatcher = getattr(model_config, "moe_token_dispatcher_type", None)
    return Settings(options, tuple(violations), full, dispatcher)


def defer_overlap_flag(model_config: Any) -> bool:
    """After ``CommOverlapConfig.setup`` wrote the resolved flags: where Megatron-Core's checks of ``model_config``
    are still to run (a Megatron-Bridge model provider), this project's schedule runs the layers and the pipeline
    has no virtual stages, Megatron-Core's ``TransformerConfig`` would refuse ``overlap_moe_expert_parallel_comm``
    (and ``delay_wgrad_compute``, which needs it). Then they stay off the config until :func:`apply_deferred`; the
    note is the config's ``ep_overlap_deferred``. Returns whether they were deferred."""
    plain_pipeline = (getattr(model_config, "pipeline_model_parallel_size", 1) or 1) > 1 and (
        getattr(model_config, "virtual_pipeline_model_parallel_size", None) is None
    )
    if not (
        getattr(model_config, "overlap_moe_expert_parallel_comm", False)
        and plain_pipeline
        and defers_mcore_checks(model_config)
        and schedule_of(model_config) == "bridge"
    ):
        return False
    deferred = {"overlap_moe_expert_parallel_comm": True}
    if getattr(model_config, "delay_wgrad_compute", False):
        deferred["delay_wgrad_compute"] = True
    setattr(model_config, DEFERRED, deferred)
    for name in deferred:
        setattr(model_config, name, False)
    logger.info(
        "EP overlap in the plain 1F1B pipeline: %s set once Megatron-Core's checks of the model config have run "
        "(its TransformerConfig refuses them without virtual stages).",
        " and ".join(deferred),
    )
    return True


def apply_deferred(model_config: Any, *, built: bool = False) -> dict[str, Any]:
    """Sets on ``model_config`` what :func:`defer_overlap_flag` kept off it; returns those fields. ``built``: the
    model was built without them (the hook), so its linears compute their weight gradients in the backward."""
    deferred = getattr(model_config, DEFERRED, None) or {}
    for name, value in deferred.items():
        setattr(model_config, name, value)
    if deferred:
        setattr(model_config, DEFERRED, None)
    if built and deferred.get("delay_wgrad_compute"):
        logger.warning(
            "delay_wgrad_compute reached the model config after the model was built (the plain 1F1B pipeline): "
            "Transformer Engine's linears compute their weight gradients in the backward, so nothing is delayed "
            "(numbers are unchanged). This project's patch to Megatron-Bridge's setup sets it before the build "
            "(tools/upstream.py patch)."
        )
    return dict(deferred)
