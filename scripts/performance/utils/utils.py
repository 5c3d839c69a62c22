"""Config helpers shared by the performance scripts (upstream's ``scripts/performance/utils/utils.py`` surface)."""

from typing import Any

# The flex backends upstream knows (0.6.2 added ncclep); a literal, as an installed upstream module may lack a list.
FLEX_BACKENDS = ("deepep", "hybridep", "ncclep")


def finalize_config_overrides(config: Any) -> Any:
    """Re-establishes the invariants between fields once every flag and ``key=value`` override is applied.

    Overrides win over flags, so fields that depend on others are settled only at the end:

    * NCCL userbuffers (``ddp.nccl_ub``) turn ``average_in_collective`` off and, with Megatron FSDP, need manual
      buffer registration; without userbuffers manual registration is switched off.
    * A flex backend on an MoE model selects the flex dispatcher (and turns shared-expert overlap off); a
      cleared backend (``None``) takes a flex model back to alltoall. A backend that an earlier fallback
      cleared therefore stays off.

    Args:
        config: A recipe with ``ddp`` and ``model`` sections, modified in place.

    Returns:
        The same config.
    """
    ddp, model = config.ddp, config.model
    if getattr(ddp, "nccl_ub", False):
        ddp.average_in_collective = False
        if getattr(ddp, "use_megatron_fsdp", False):
            ddp.fsdp_manual_registration = True
    elif getattr(ddp, "fsdp_manual_registration", False):
        ddp.fsdp_manual_registration = False

    backend = getattr(model, "moe_flex_dispatcher_backend", None)
    if backend in FLEX_BACKENDS and getattr(model, "num_moe_experts", None):
        model.moe_token_dispatcher_type = "flex"
        model.moe_shared_expert_overlap = False
    elif backend is None and getattr(model, "moe_token_dispatcher_type", None) == "flex":
        model.moe_token_dispatcher_type = "alltoall"
    return config
