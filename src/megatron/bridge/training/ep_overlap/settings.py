"""A model's EP-overlap settings, resolved once (no torch here). :func:`resolve` is the only place they are derived;
consumers read the frozen :class:`Settings`. An invalid setting is a violation (one line, with its fix).
:func:`defer_overlap_flag` keeps the overlap flags off a Bridge provider whose Megatron-Core checks would refuse them
(PP > 1 without virtual stages, or MTP > 1); :func:`apply_deferred` sets them later."""

import logging
from dataclasses import dataclass
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

_RECOMPUTE_RULES = ("full_recompute_method", "full_recompute_num_layers")
# A model config's note of the fields the hook sets once the config is built (Megatron-Core's checks refuse them).
DEFERRED = "ep_overlap_deferred"


@dataclass(frozen=True)
class Settings:
    """What :func:`resolve` derived; ``full_recompute`` is ``(recompute_method, recompute_num_layers)`` or None."""

    options: EPOverlapOptions
    violations: tuple[Violation, ...] = ()
    full_recompute: tuple[Any, Any] | None = None
    token_dispatcher: str | None = None

    @property
    def delay_wgrad(self) -> bool:
        return self.options.overlap and self.options.delay_wgrad

    @property
    def wgrad_window_auto(self) -> bool:
        """Delayed wgrad with ``attention_wgrad_window=None``: no window chosen yet (the hook refuses it)."""
        return self.delay_wgrad and self.options.attention_wgrad_window is None

    @property
    def attention_wgrad_window(self) -> int:
        """The options' window, else 1 (while the planner is to choose, only steps that place none run)."""
        window = self.options.attention_wgrad_window
        return WGRAD_WINDOWS[0] if window is None else window

    @property
    def moe_layers_own_comm(self) -> bool:
        return self.token_dispatcher == "flex"

    def checked(self) -> "Settings":
        if self.violations:
            raise CommOverlapConfigError(self.violations)
        return self

    def segments(self, num_layers: int) -> tuple[tuple[int, int], ...]:
        """Full recompute's ``(first, stop)`` segments of ``num_layers`` layers (none without full recompute)."""
        if self.full_recompute is None:
            return ()
        broken = [v for v in self.violations if v.name in _RECOMPUTE_RULES]
        if broken:
            raise CommOverlapConfigError(broken)
        method, n = self.full_recompute
        if method == "uniform":
            return tuple((i, min(i + n, num_layers)) for i in range(0, num_layers, n))
        return tuple((i, i + 1) for i in range(min(n, num_layers)))


def resolve(
    model_config: Any,
    options: EPOverlapOptions | None = None,
    *,
    overlap_grad_reduce: bool = False,
    micro_batch_size: int | None = None,
    torch_at_least=None,
    te_at_least=None,
    model_config_built: bool = True,
    megatron_fsdp: bool = False,
) -> Settings:
    """The settings of ``model_config`` with ``options`` (None: from the config); the keywords are what a caller knows
    beyond them (version checks default to what is installed)."""
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
        megatron_fsdp=megatron_fsdp,
    )
    full = None
    if getattr(model_config, "recompute_granularity", None) == "full":
        full = (getattr(model_config, "recompute_method", None), getattr(model_config, "recompute_num_layers", None))
    dispatcher = getattr(model_config, "moe_token_dispatcher_type", None)
    return Settings(options, tuple(violations), full, dispatcher)


def defer_overlap_flag(model_config: Any) -> bool:
    """After ``CommOverlapConfig.setup``: keeps the overlap (and delayed-wgrad) flags off a provider whose checks would
    refuse them, noted in ``ep_overlap_deferred``; returns whether it did."""
    plain_pipeline = (getattr(model_config, "pipeline_model_parallel_size", 1) or 1) > 1 and (
        getattr(model_config, "virtual_pipeline_model_parallel_size", None) is None
    )
    mtp_depths = (getattr(model_config, "mtp_num_layers", None) or 0) > 1  # Megatron-Core's checks allow one
    moe_recompute = "moe" in (getattr(model_config, "recompute_modules", None) or ()) or bool(
        getattr(model_config, "moe_layer_recompute", False)
    )  # Megatron-Core's checks refuse it; the plan replays the MoE part
    if not (
        getattr(model_config, "overlap_moe_expert_parallel_comm", False)
        and (plain_pipeline or mtp_depths or moe_recompute)
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
        "EP overlap in the plain 1F1B pipeline, with several MTP layers or with 'moe' recomputed: %s set once "
        "Megatron-Core's checks of the model config have run (its TransformerConfig refuses them there).",
        " and ".join(deferred),
    )
    return True


def delayed_wgrad_to_ddp(model_config: Any, ddp_config: Any) -> None:
    """Sets the DDP config's ``delay_wgrad_compute`` where the model config's is on, as Megatron-LM's arguments do
    (Bridge leaves it off): only with it does Megatron-Core's DDP take a delaying Transformer Engine linear's weight
    gradient into ``main_grad`` and the grad reduce from ``backward_dw``. Without it, each microbatch's delayed weight
    gradient reaches ``main_grad`` in the next microbatch's backward and the step's last one never (without
    ``gradient_accumulation_fusion``), or the overlapped grad reduce starts before them."""
    if getattr(model_config, "delay_wgrad_compute", False) and not getattr(ddp_config, "delay_wgrad_compute", True):
        ddp_config.delay_wgrad_compute = True
        logger.info(
            "ddp.delay_wgrad_compute set to True with the model's delay_wgrad_compute, as Megatron-LM sets both: "
            "else the DDP hooks miss delayed weight gradients."
        )


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
