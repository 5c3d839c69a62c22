"""Test-only: the recipe check's universe, found by built config, not by source text.

Every config function of Megatron-Bridge 0.6.2's ``megatron.bridge.recipes`` (what the package exports) and of each
family package of ``megatron.bridge.perf_recipes`` is named by its package: ``recipes.<name>`` or
``perf_recipes.<name>`` (some names exist in both). Each is built as a user builds it; those that build a MoE model
(more than one expert) with ``expert_model_parallel_size`` above 1 are the universe, whatever their overlap flag
says. The recipe's own setting is read off the built config (``on``, ``off``, ``unset``) or its source
(``commented out``: the function has the line and a ``#`` before it).
"""

import importlib
import inspect
import pkgutil
import re

PACKAGES = ("recipes", "perf_recipes")
_COMMENTED = re.compile(r"#\s*cfg\.comm_overlap\.overlap_moe_expert_parallel_comm")


def config_functions() -> dict[str, object]:
    """Qualified name -> recipe function, in name order."""
    import megatron.bridge.perf_recipes as perf
    import megatron.bridge.recipes as recipes

    found = {f"recipes.{n}": getattr(recipes, n) for n in dir(recipes) if _is_config(recipes, n)}
    for family in pkgutil.iter_modules(perf.__path__):
        if not family.ispkg:
            continue
        module = importlib.import_module(f"{perf.__name__}.{family.name}")
        found |= {f"perf_recipes.{n}": getattr(module, n) for n in dir(module) if _is_config(module, n)}
    return dict(sorted(found.items()))


def _is_config(module, name: str) -> bool:
    return name.endswith("_config") and not name.startswith("_") and inspect.isfunction(getattr(module, name))


def resolve_name(name: str, known: list[str]) -> tuple[str | None, str | None]:
    """``name`` (qualified, or bare when one package has it) as a qualified name; else None and why, with the fix."""
    if name in known:
        return name, None
    matches = [q for q in known if q.split(".", 1)[1] == name]
    if len(matches) == 1:
        return matches[0], None
    if matches:
        return None, f"{name}: in both packages; fix: name one of {', '.join(matches)}"
    return None, (
        f"{name}: not a recipe function of megatron-bridge 0.6.2; fix: a name from "
        "`python tools/recipe_check.py --list`"
    )


def is_moe_with_ep(model) -> bool:
    return (getattr(model, "num_moe_experts", None) or 0) > 1 and (model.expert_model_parallel_size or 1) > 1


def setting(cfg, function) -> str:
    """The recipe's own overlap setting: ``on``, ``off``, ``unset`` or ``commented out``."""
    if _COMMENTED.search(inspect.getsource(function)):
        return "commented out"
    flag = getattr(cfg.comm_overlap, "overlap_moe_expert_parallel_comm", None) if cfg.comm_overlap else None
    if getattr(cfg.model, "overlap_moe_expert_parallel_comm", None):
        flag = True
    return {True: "on", False: "off"}.get(flag, "unset")


def family(function) -> str:
    """The recipe's model family: its module's name (``qwen3_moe``, ``deepseek_v3``, ...)."""
    return function.__module__.rsplit(".", 1)[-1]
