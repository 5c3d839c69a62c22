"""Test-only: the recipe check's two verdicts on one recipe.

* :func:`gpu_verdict`, **as the recipe is, on a GPU**: this project's EP-overlap rules (``moe_overlap_rules``, through
  ``settings.resolve`` as the hook runs them) on the recipe's own, unshrunk and unsubstituted model config with the
  overlap turned on as ``--moe_a2a_overlap true`` turns it on (the flag and delayed wgrad; a recipe's full recompute
  through the hook's keyword, the fix the rules name), with Transformer Engine and a recent torch present, and this
  project's patch applied where the layout needs it; and the plan's own build-time refusals that the config decides
  (``refusals.config_refusals``). ``runs``, or ``refused`` with the rules' and refusals' names.
* :func:`verdict`, **on CPU**: the shrunk run's records, ``bitwise``, ``refused``, ``differs`` or ``failed``.
"""

import copy
import re

STEPS = 2


def gpu_verdict(cfg) -> dict:
    """``runs`` or ``refused`` (the rules' and the plan's names), for ``cfg`` as built by its recipe (see the module
    docstring)."""
    from megatron.bridge.training.ep_overlap.mcore.refusals import config_refusals
    from megatron.bridge.training.ep_overlap.options import EPOverlapOptions
    from megatron.bridge.training.ep_overlap.settings import resolve
    from megatron.bridge.training.moe_overlap_rules import use_bridge_schedule

    model = copy.deepcopy(cfg.model)
    model.overlap_moe_expert_parallel_comm = model.delay_wgrad_compute = True
    model.moe_shared_expert_overlap = False
    use_bridge_schedule(model)
    settings = resolve(
        model,
        EPOverlapOptions(overlap=True, delay_wgrad=True, attention_wgrad_window=1),
        overlap_grad_reduce=bool(getattr(cfg.ddp, "overlap_grad_reduce", False)),
        megatron_fsdp=bool(getattr(cfg.ddp, "use_megatron_fsdp", False)),  # with PP > 1 refused (rule megatron_fsdp)
        micro_batch_size=getattr(cfg.train, "micro_batch_size", None),
        torch_at_least=lambda version: True,
        te_at_least=lambda version: True,
        model_config_built=False,
    )
    # A recipe's full recompute goes through the hook's keyword (the fix this rule names); every other full-recompute
    # rule still reads it.
    names = {violation.name for violation in settings.violations} - {"full_recompute_in_the_recipe"}
    names |= {name for name, _ in config_refusals(model)}
    if names:
        return {"verdict": "refused", "rules": sorted(names), "why": ", ".join(sorted(names))}
    return {"verdict": "runs", "rules": [], "why": ""}


def verdict(ranks: list[dict]) -> dict:
    """``bitwise``, ``refused`` (rule names), ``differs`` (the first tensor) or ``failed`` (the error line)."""
    return (
        _first_error(ranks)
        or _first_difference(ranks)
        or {
            "verdict": "bitwise",
            "why": f"{STEPS} steps, losses, gradients and parameters on {len(ranks)} ranks",
        }
    )


_SECONDARY = ("by peer", "imed out", "Timeout")  # words of a rank's error that follows another rank's failure


def _first_error(ranks: list[dict]) -> dict | None:
    """The refusal or failure of the first rank and arm that raised; a peer's lost connection or timeout, which
    follows another rank's failure, only when there is nothing else."""
    raised = [(rank, arm, arms[arm]) for rank, arms in enumerate(ranks) for arm in ("plain", "hook")
              if "error" in arms.get(arm, {})]  # fmt: skip
    for rank, arm, run in sorted(raised, key=lambda r: any(w in r[2]["error"] for w in _SECONDARY)):
        if run.get("refused"):
            rules = sorted(set(re.findall(r"\[([a-z0-9_]+)\]", run["error"])))
            return {"verdict": "refused", "why": ", ".join(rules) or run["error"].splitlines()[-1]}
        return {"verdict": "failed", "why": f"{arm} arm, rank {rank}: {run['error']}", "trace": run["trace"]}
    return None


def _first_difference(ranks: list[dict]) -> dict | None:
    """Where the hook arm's record first differs from the plain arm's (each step's losses, gradients and parameters
    are dicts by name), or the hook arm did not run this project's plan."""
    hooks = [arms["hook"] for arms in ranks]
    ran = all(hook["overlap_flag"] and hook["plan"] == "EPOverlapPlanBuilder" for hook in hooks)
    if not ran or not any(hook["dispatches"] for hook in hooks):  # a stage of dense layers dispatches nothing
        return {"verdict": "failed", "why": "the hook arm did not run this project's plan"}
    for rank, arms in enumerate(ranks):
        plain, hook = arms["plain"], arms["hook"]
        for step in range(STEPS):
            for what in ("losses", "grads", "params"):
                mine, theirs = plain[what][step], hook[what][step]
                for name in sorted(mine.keys() | theirs.keys()):
                    if mine.get(name) != theirs.get(name):
                        return {"verdict": "differs", "why": f"rank {rank} step {step} {what} {name}"}
    return None
