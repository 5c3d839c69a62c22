"""``ep_overlap_plan.py --recipe``: Megatron-Bridge 0.6.2 recipes built offline, as the recipe check builds them, and
priced by ``ep_overlap_lab.planner.recipe``.

Building a recipe needs torch and the stock package, so it runs in the recipe check's scratch interpreter
(``tests/functional_tests/stock_bridge.py``; ``plan_recipe_worker.py`` in it). What it reads off each built recipe is
cached under ``build/plan-recipes/`` (keyed by the package, the worker and the offline stand-ins), so only a recipe's
first pricing waits for the build; the planner itself imports no torch.

:func:`predicted_gain` is the recipe check's entry: a built config in, the predicted speedup (or why not) out.
"""

import fcntl
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

from utils.plan_recipe_worker import fields_of

ROOT = Path(__file__).resolve().parents[3]
CACHE = Path(os.environ.get("EP_OVERLAP_PLAN_RECIPES", ROOT / "build" / "plan-recipes"))  # tests point it elsewhere
WORKER = Path(__file__).with_name("plan_recipe_worker.py")
_KEYED = (WORKER, ROOT / "tests" / "functional_tests" / "recipe_check" / "offline.py",
          ROOT / "tests" / "functional_tests" / "recipe_check" / "universe.py")  # fmt: skip
PERF = "__perf__"


class RecipeBuildError(RuntimeError):
    """The recipes could not be built here at all; ``str()`` is the one line to print."""


def _cache_file() -> Path:
    digest = hashlib.sha256()
    for path in _KEYED:
        digest.update(path.read_bytes())
    for path in sorted((ROOT / "build").glob("megatron-bridge-*/*")) + sorted(
        (ROOT / "tests" / "functional_tests" / "hf_configs").glob("*.json")
    ):
        digest.update(path.name.encode())
    return CACHE / f"{digest.hexdigest()[:16]}.json"


def _build(args: list[str]) -> dict:
    """The worker's answer for ``args`` (names, or ``--perf``), in the scratch interpreter."""
    sys.path.insert(0, str(ROOT))
    from tests.functional_tests import stock_bridge

    # The same interpreter as the recipe check's, in a folder of its own: the check may be rebuilding its copy (which
    # starts by removing it) at the same moment. A lock keeps two planner runs from building this one at once.
    CACHE.mkdir(parents=True, exist_ok=True)
    shared = stock_bridge.CACHE
    with (CACHE / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stock_bridge.CACHE = CACHE / "stock-bridge"
        try:
            python = stock_bridge.scratch_env()
            tree = stock_bridge.site_packages(python)
        except Exception as exc:  # no registry here, say
            raise RecipeBuildError(f"cannot make the recipe check's scratch interpreter here: {exc}") from None
        finally:
            stock_bridge.CACHE = shared
    with tempfile.TemporaryDirectory(prefix="plan-recipe-") as scratch:
        out = Path(scratch) / "fields.json"
        run = stock_bridge.run(python, tree, WORKER, str(out), *args, timeout=3600)
        if run.returncode != 0 or not out.exists():
            last = (run.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RecipeBuildError(f"building the recipes failed: {last}")
        return json.loads(out.read_text())


def recipe_fields(names: list[str] | None = None) -> dict:
    """``{name: {"fields": ...} | {"why": ...}}`` for ``names`` (None: every performance recipe the recipe check
    lists, under :data:`PERF` too), built once and then read from the cache."""
    path = _cache_file()
    cached = json.loads(path.read_text()) if path.exists() else {}
    wanted = [PERF] if names is None else names
    missing = [n for n in wanted if n not in cached]
    if missing:
        cached |= _build(["--perf"] if names is None else missing)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cached))
    return cached


def predicted_gain(cfg, name: str, profile: str | None = None, gpus: int | None = None) -> dict:
    """The planner's verdict on a built recipe config ``cfg`` named ``name`` (its hardware and GPU count come from the
    name unless given): ``{"speedup", "plain_s", "overlap_s", "profile", "gpus", "microbatches", "notes"}``, or
    ``{"why": one line}`` where it cannot price it. Torch-free itself; ``cfg`` is only read."""
    return gain_of(fields_of(cfg), name, profile, gpus)


def gain_of(fields: dict, name: str, profile: str | None = None, gpus: int | None = None) -> dict:
    from ep_overlap_lab.planner.recipe import RecipeRefusal, price_recipe

    try:
        price = price_recipe(fields, name, profile, gpus)
    except RecipeRefusal as exc:
        return {"why": str(exc)}
    return {
        "speedup": price.speedup, "plain_s": price.plain_s, "overlap_s": price.overlap_s, "price": price,
        "profile": price.profile, "gpus": price.gpus, "microbatches": price.microbatches, "notes": price.notes,
    }  # fmt: skip


def recipe_lines(price) -> list[str]:
    """The CLI's lines: first the recipe as it is with the overlap on, then the other delayed-wgrad setting."""
    d = price.dispatcher
    backend = d.backend + (f", {d.sms} SMs" if d.backend != "alltoall" else "")
    backend += ", static shapes" if d.static_shape else ""
    as_is = "delayed wgrad" if price.delay_wgrad else "no delayed wgrad"
    other = "no delayed wgrad" if price.delay_wgrad else "delayed wgrad"
    return [
        f"{price.name}: as it is, overlap on ({as_is}): plain {price.plain_s:.3f} s, overlapped "
        f"{price.overlap_s:.3f} s, speedup {price.speedup:.3f}x",
        f"  with {other}: overlapped {price.other_s:.3f} s, speedup {price.plain_s / price.other_s:.3f}x",
        f"  {price.gpus} x {price.profile}, {price.microbatches} microbatches per step, {backend}; the recipe has "
        f"the overlap {'on' if price.recipe_overlap else 'off'}",
    ] + [f"  approximated: {note}" for note in price.notes]


def print_recipes(args) -> int:
    """``--recipe NAME``: its lines, or one ``error:`` line and exit 2. ``--all_recipes``: one row per performance
    recipe the recipe check lists (priced, or why not), then the counts; exit 0."""
    try:
        fields = recipe_fields(None if args.all_recipes else [args.recipe])
    except RecipeBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.recipe:
        built = fields[args.recipe]
        gain = gain_of(built["fields"], args.recipe, args.profile, args.gpus) if "fields" in built else built
        if "why" in gain:
            print(f"error: --recipe={args.recipe}: {gain['why']}", file=sys.stderr)
            return 2
        print("\n".join(recipe_lines(gain["price"])))
        return 0
    priced = refused = 0
    gains = []
    print("| recipe | recipe's overlap | GPUs | microbatches | dispatcher | plain (s) | overlapped (s) | speedup "
          "| why not priced |")  # fmt: skip
    print("|---" * 9 + "|")
    for name in fields[PERF]:
        built = fields[name]
        gain = gain_of(built["fields"], name, args.profile, args.gpus) if "fields" in built else built
        if "why" in gain:
            refused += 1
            print(f"| `{name}` | | | | | | | | {gain['why'].replace('|', '/')} |")
            continue
        priced += 1
        price = gain["price"]
        setting = ("on" if price.recipe_overlap else "off") + (", delayed wgrad" if price.delay_wgrad else "")
        print(f"| `{name}` | {setting} | {price.gpus} x {price.profile} | {price.microbatches} | "
              f"{price.dispatcher.backend} | {price.plain_s:.2f} | {price.overlap_s:.2f} | {price.speedup:.3f}x "
              "| |")  # fmt: skip
        gains.append(price.speedup)
    print(f"\n{priced} priced, {refused} not priced, of {priced + refused} performance recipes the recipe check lists")
    if gains:
        gains.sort()
        print(f"predicted speedup: median {gains[len(gains) // 2]:.3f}x, {sum(g >= 1.1 for g in gains)} at 1.10x or "
              f"more, {sum(g < 1.03 for g in gains)} under 1.03x")  # fmt: skip
    return 0
