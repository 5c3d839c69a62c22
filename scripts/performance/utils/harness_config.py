"""The harness's recipe and arms, checked before any rank starts: flags and overrides applied, Megatron-Core's own
validation, each arm's model config through ``CommOverlapConfig.setup`` and its schedule options through the rules.
A problem is one line (field, value, fix) in a :class:`ConfigError`."""

import dataclasses

from megatron.bridge.training.ep_overlap.options import EPOverlapOptions
from megatron.bridge.training.ep_overlap.settings import resolve
from megatron.bridge.training.moe_overlap_rules import CommOverlapConfigError
from utils.checks import (
    flag_problems,
    lift_model_overlap_flags,
    model_impl_problems,
    pipeline_dtype_auto,
    pipeline_run_problems,
    recipe_problems,
    run_problems,
)
from utils.overrides import apply_flag_overrides, apply_overrides
from utils.recipe import RecipeConfig, small_moe_recipe


class ConfigError(Exception):
    """Configuration problems, printed one per line without a traceback (exit status 2)."""

    def __init__(self, problems: list[str]):
        self.problems = [" ".join(str(p).split()) for p in problems]
        super().__init__("\n".join(self.problems))


def _violation_lines(exc: CommOverlapConfigError, prefix: str = "") -> list[str]:
    return [f"{prefix}{violation}" for violation in exc.violations]


def build_recipe(args) -> RecipeConfig:
    """The recipe with flags, then key=value overrides, applied and every value checked.

    Raises:
        ConfigError: Listing every problem found.
    """
    recipe, problems = _recipe_with_problems(args)
    if problems:
        raise ConfigError(problems)
    return _finalized(recipe)


def _recipe_with_problems(args) -> tuple[RecipeConfig, list[str]]:
    """Flags and overrides applied (bad overrides are reported, not applied), and every problem of the result."""
    recipe = small_moe_recipe()
    problems = apply_overrides(recipe, args.overrides, apply_flag_overrides(recipe, args))
    # Fields the model config derived from the recipe's own shape: derived again from the final one (finalize),
    # unless an override set them. Kept, they would give a Megatron-Core model the recipe's head size.
    given = {item.partition("=")[0].strip() for item in args.overrides}
    for name in ("kv_channels", "num_query_groups", "microbatch_group_size_per_vp_stage"):
        if f"model.{name}" not in given:
            setattr(recipe.model, name, None)
    problems += lift_model_overlap_flags(recipe)
    problems += model_impl_problems(recipe.model, args.model_impl, args.num_layers)
    problems += recipe_problems(recipe, args.pipeline_schedule)
    if not problems:
        pipeline_dtype_auto(recipe.model)
    return recipe, problems


def _finalized(recipe: RecipeConfig) -> RecipeConfig:
    """The comm_overlap and Megatron-Core's own model-config validation, once our checks found nothing."""
    try:
        recipe.comm_overlap.finalize()
    except CommOverlapConfigError as exc:
        raise ConfigError(_violation_lines(exc)) from exc
    try:
        # Re-run the model config's own validation on the overridden values (Bridge's finalize()).
        recipe.model = dataclasses.replace(recipe.model)
    except (AssertionError, ValueError) as exc:
        raise ConfigError([f"model config: {exc}"]) from exc
    return recipe


def resolve_arm(recipe: RecipeConfig, name: str, overlap: bool | None, delay: bool | None) -> dict:
    """Resolves one arm's model config through CommOverlapConfig.setup (the rules run here)."""
    model = dataclasses.replace(recipe.model)
    comm_overlap = dataclasses.replace(recipe.comm_overlap)
    if overlap is not None:
        comm_overlap.overlap_moe_expert_parallel_comm = overlap
    if delay is not None:
        comm_overlap.delay_wgrad_compute = delay
    try:
        comm_overlap.setup(model)
    except CommOverlapConfigError as exc:
        raise ConfigError(_violation_lines(exc, f"{name} arm: ")) from exc
    return {
        "name": name,
        "model": model,
        "overlap": bool(model.overlap_moe_expert_parallel_comm),
        "delay_wgrad": bool(model.delay_wgrad_compute),
    }


def arms_of(recipe: RecipeConfig, args) -> list[dict]:
    """The arms of a run, each with its model config and the schedule's options (``options``): the flags' options
    go to the arm that runs the overlap schedule (a single run: to its one arm), the A/B baseline runs plain."""
    if not args.ab:
        arms = [resolve_arm(recipe, "run", None, None)]
    else:  # the overlap arm keeps the config's delayed-wgrad choice; the baseline turns both knobs off
        arms = [resolve_arm(recipe, "baseline", False, False), resolve_arm(recipe, "overlap", True, None)]
    for arm in arms:
        arm["options"] = (
            EPOverlapOptions(overlap=False)
            if arm["name"] == "baseline"
            else EPOverlapOptions(
                overlap=arm["overlap"],
                delay_wgrad=arm["delay_wgrad"],
                attention_wgrad_window=args.attention_wgrad_window,
                edge_pairing=args.edge_pairing,
                moe_ep_overlap_chunks=args.moe_ep_overlap_chunks,
                launch_off_host=args.launch_off_host,
            )
        )
    return arms


def options_problems(arms: list[dict], recipe: RecipeConfig) -> list[str]:
    """Each arm's schedule options against the rules table: the lines the engine would raise, before any rank."""
    return [
        f"{arm['name']} arm: {violation}"
        for arm in arms
        for violation in resolve(
            arm["model"], arm["options"], micro_batch_size=recipe.train.micro_batch_size
        ).violations
    ]


def checked_run(args, world: int, torchrun: bool, gpus: int) -> tuple[RecipeConfig, list[dict]]:
    """The finalized recipe and its arms, every flag, override, launch setting and arm checked.

    Raises:
        ConfigError: Listing every problem found.
    """
    recipe, problems = _recipe_with_problems(args)
    pipeline = recipe.model.pipeline_model_parallel_size
    problems += run_problems(
        args, world, recipe.model.expert_model_parallel_size, torchrun, gpus, pipeline if pipeline else 1
    )
    problems += pipeline_run_problems(args, recipe.model, torchrun, gpus > 0)
    if args.predict and recipe.model.moe_token_dispatcher_type == "flex":
        problems.append(
            "--predict: the planner prices each all-to-all by the bytes it moves, which a flex backend's "
            "fused kernels do not report; drop --predict or the flex backend"
        )
    if problems:
        raise ConfigError(problems)
    recipe = _finalized(recipe)
    arms = arms_of(recipe, args)
    problems = flag_problems(args, arms, recipe) + options_problems(arms, recipe)
    if problems:
        raise ConfigError(problems)
    return recipe, arms
