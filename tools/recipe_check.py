"""Check Megatron-Bridge 0.6.2's own recipes against this project's EP overlap, on CPU, before a cluster runs them.

  make recipe-check RECIPES="qwen3_30b_a3b_pretrain_8gpu_h100_bf16_config gpt_oss_20b_pretrain_16gpu_h100_bf16_config"
    make recipe-check RECIPES=--all          # every recipe that turns the overlap on or has its line commented out
    python tools/recipe_check.py --list      # the recipe functions of the installed 0.6.2
    python tools/recipe_check.py NAME ... [--no_delay_wgrad] [--json rows.json] [--markdown table.md]

Each recipe is built as a user builds it, the overlap turned on as Bridge's performance scripts' ``--moe_a2a_overlap
true`` does (overlap and delayed wgrad; ``--no_delay_wgrad``: the overlap alone), shrunk to CPU size with its
structure and every parallel size above 1 kept above 1 (at most 8 ranks), and trained 2 steps by stock Bridge's own
``train()`` with this project's plugin, overlap off and on (``tests/functional_tests/recipe_check_worker.py`` says
exactly what and what it substitutes). Bridge with this project's patch instead where the layout needs it (the plain
1F1B pipeline). One row per recipe: the shape it ran, what it substituted on CPU, the verdict (``bitwise``,
``refused`` with the rules' names, ``differs`` with the first tensor, ``failed`` with the error line); the last line
is ``recipes: B bitwise, R refused, D differ, F failed of N``. Exit status 0 only when nothing differs or failed;
2 for a name that is not a recipe, one line each.

The first run builds a scratch venv under ``build/stock-bridge/`` (Bridge 0.6.2 from the package registry and what
its loop imports); no run reaches the Hugging Face hub: each model's config is ``transformers``' own for its type
(named in the row's ``config``).
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "functional_tests" / "recipe_check_worker.py"
VERDICTS = ("bitwise", "refused", "differs", "failed")


class Trees:
    """The scratch interpreter and the two ``megatron.bridge`` trees it runs: stock 0.6.2 with the plugin, and the
    0.6.2 sources with the patch (made on first use)."""

    def __init__(self, scratch: Path):
        sys.path.insert(0, str(ROOT))
        from tests.functional_tests import stock_bridge

        self.stock_bridge, self.scratch = stock_bridge, scratch
        self.python = stock_bridge.scratch_env()
        self.plugin = stock_bridge.plugin_tree(self.python)
        self._patched = None

    @property
    def patched(self) -> Path:
        if self._patched is None:
            shutil.rmtree(self.scratch / "patched", ignore_errors=True)
            self._patched = self.stock_bridge.patched_tree(self.scratch / "patched")
        return self._patched

    def worker(self, tree: Path, *args: str) -> dict:
        out = self.scratch / "row.json"
        out.unlink(missing_ok=True)
        try:
            run = self.stock_bridge.run(self.python, tree, WORKER, str(out), *args, timeout=1200)
        except subprocess.TimeoutExpired:
            return {"verdict": "failed", "why": "timed out after 1200 s"}
        if run.returncode != 0 or not out.exists():
            lines = run.stderr.strip().splitlines() or ["(no output)"]
            return {"verdict": "failed", "why": f"the worker exited {run.returncode}: {lines[-1]}"}
        return json.loads(out.read_text())


def check(trees: Trees, name: str, delay_wgrad: bool) -> dict:
    """One recipe's row: with the plugin, or with the patch where the plugin cannot run the layout."""
    extra = [] if delay_wgrad else ["--no_delay_wgrad"]
    row = trees.worker(trees.plugin, "--recipe", name, *extra)
    if row.get("needs_patch"):
        row = trees.worker(trees.patched, "--recipe", name, "--patched", *extra)
    return {"recipe": name} | row


def table(rows: list[dict]) -> list[str]:
    """The rows as a Markdown table, and the summary line."""
    lines = ["| recipe | recipe's shape | shape run | substituted on CPU | config | verdict |", "|---" * 6 + "|"]
    for row in rows:
        substituted = "; ".join(row.get("substituted", [])) or "-"
        config = "; ".join(row.get("config", [])) or "-"
        verdict = f"**{row['verdict']}**: {row.get('why', '')}".replace("|", "/")
        lines.append(f"| `{row['recipe']}` | {row.get('recipe_shape', '-')} | {row.get('shape', '-')} "
                     f"| {substituted} | {config} | {verdict} |")  # fmt: skip
    return lines + ["", summary(rows)]


def summary(rows: list[dict]) -> str:
    count = {verdict: sum(row["verdict"] == verdict for row in rows) for verdict in VERDICTS}
    return (f"recipes: {count['bitwise']} bitwise, {count['refused']} refused, {count['differs']} differ, "
            f"{count['failed']} failed of {len(rows)}")  # fmt: skip


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipes", nargs="*", help="recipe function names of megatron-bridge 0.6.2")
    parser.add_argument("--all", action="store_true", help="every recipe that turns the overlap on or comments it")
    parser.add_argument("--list", action="store_true", help="print the recipe function names and stop")
    parser.add_argument("--no_delay_wgrad", action="store_true", help="the overlap without delayed wgrad")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--markdown", type=Path, help="also write the table and the summary line here")
    args = parser.parse_args(argv)
    if not (args.recipes or args.all or args.list):
        parser.error("give recipe names, --all or --list")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="recipe-check-") as scratch:
        trees = Trees(Path(scratch))
        known = trees.worker(trees.plugin, "--list")
        if "all" not in known:
            print(f"error: could not list the recipes: {known.get('why')}", file=sys.stderr)
            return 1
        if args.list:
            print("\n".join(known["all"]))
            return 0
        unknown = [name for name in args.recipes if name not in known["all"]]
        for name in unknown:
            print(f"error: {name}: not a recipe function of megatron-bridge 0.6.2; fix: a name from "
                  "`python tools/recipe_check.py --list`", file=sys.stderr)  # fmt: skip
        if unknown:
            return 2
        rows = []
        for name in known["overlap"] if args.all else args.recipes:
            rows.append(check(trees, name, not args.no_delay_wgrad))
            row = rows[-1]
            print(f"{name}: {row.get('shape', '-')}: {row['verdict']}: {row.get('why', '')}", flush=True)
    lines = table(rows)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n")
    failing = sum(row["verdict"] in ("differs", "failed") for row in rows)
    return 0 if failing == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
