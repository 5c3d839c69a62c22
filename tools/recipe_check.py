"""Check Megatron-Bridge 0.6.2's own MoE recipes against this project's EP overlap, on CPU, before a cluster runs them.

    make recipe-check RECIPES="perf_recipes.qwen3_30b_a3b_pretrain_8gpu_h100_bf16_config ..."
    make recipe-check RECIPES=--all          # every MoE config with expert parallelism above 1
    python tools/recipe_check.py --list      # that universe, with each recipe's own overlap setting
    python tools/recipe_check.py NAME ... [--no_delay_wgrad] [--json rows.json] [--markdown table.md]

The universe is found by built config: every config function of ``megatron.bridge.recipes`` and
``megatron.bridge.perf_recipes`` that builds a MoE model with ``expert_model_parallel_size > 1``, whatever its overlap
flag says. A name is qualified by its package (``recipes.NAME`` or ``perf_recipes.NAME``); a bare name is taken when
one package has it. Each config gets two verdicts:

* **GPU, as the recipe is**: this project's rules on the unshrunk config with the overlap on (``runs``, or
  ``refused`` with the rules' names);
* **CPU**: shrunk with its structure kept, the CPU substitutions named, trained 2 steps by stock Bridge's own
  ``train()`` overlap off and on (``bitwise``, ``refused``, ``differs`` with the first tensor, ``failed`` naming the
  GPU-only piece it needs, or ``not checked`` where the check itself could not: counted apart).

Configs whose CPU run would be the same (shrunk structure, substitutions) share one run; every config keeps its row.
``tests/functional_tests/recipe_check/`` says exactly what runs. Exit status 0 only when nothing differs and every
failure names a GPU-only piece; 2 for a name that is not a recipe, one line each. A progress line per run goes to
stderr. The first run builds a scratch venv under ``build/stock-bridge/``; no run reaches the Hugging Face hub.
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "functional_tests" / "recipe_check" / "worker.py"
CPU_VERDICTS = ("bitwise", "refused", "differs", "failed", "not checked")
# What a CPU failure says when a GPU-only piece is missing: the words, and the piece they name.
GPU_ONLY = {
    "MambaSSM is not installed": "mamba-ssm kernels (Mamba mixer)",
    "causal_conv1d": "causal-conv1d kernels",
    "flash-linear-attention": "flash-linear-attention kernels (gated delta net)",
    "TransformerEngine": "Transformer Engine",
    "Transformer Engine": "Transformer Engine",
}


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

    def worker(self, tree: Path, *args: str, timeout: int = 1200):
        out = self.scratch / "worker.json"
        out.unlink(missing_ok=True)
        try:
            run = self.stock_bridge.run(self.python, tree, WORKER, str(out), *args, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"verdict": "failed", "why": f"timed out after {timeout} s"}
        if run.returncode != 0 or not out.exists():
            lines = run.stderr.strip().splitlines() or ["(no output)"]
            return {"verdict": "not checked", "why": f"the check could not run its worker: {lines[-1]}"}
        return json.loads(out.read_text())


def cpu_runs(trees: Trees, names: list[str], patched: bool, delay_wgrad: bool, report) -> dict[str, dict]:
    """The CPU runs of ``names`` on one tree, in one worker process (its imports paid once); ``report(row)`` as each
    ends. A worker that dies fails the run it was in; the others go on in a new one."""
    results, remaining = {}, list(names)
    tree = trees.patched if patched else trees.plugin
    while remaining:
        out, log = trees.scratch / "rows.jsonl", trees.scratch / "worker.log"
        out.unlink(missing_ok=True)
        args = ["--recipes", *remaining] + (["--patched"] if patched else []) + ([] if delay_wgrad else
                                                                                  ["--no_delay_wgrad"])  # fmt: skip
        worker = trees.stock_bridge.start(trees.python, tree, WORKER, str(out), *args, log=log)
        seen = 0
        while seen < len(remaining):
            ended = worker.poll() is not None
            lines = out.read_text().splitlines() if out.exists() else []
            for line in lines[seen:]:
                row = json.loads(line)
                if row.get("verdict") == "failed":
                    row["gpu_only"] = next((piece for words, piece in GPU_ONLY.items() if words in row["why"]), None)
                results[row["recipe"]] = row
                report(row)
            seen = len(lines)
            if ended:
                break
            time.sleep(1)
        worker.wait()
        remaining = [name for name in remaining if name not in results]
        if remaining:  # the worker died in the run of remaining[0]
            last = (log.read_text().strip().splitlines() or ["(no output)"])[-1]
            why = f"the check could not finish its worker (exit {worker.returncode}): {last}"
            results[remaining[0]] = {"recipe": remaining[0], "verdict": "not checked", "why": why}
            report(results[remaining[0]])
            remaining = remaining[1:]
    return results


def table(rows: list[dict]) -> list[str]:
    """The rows as a Markdown table."""
    lines = ["| recipe | setting | recipe's shape | GPU, as it is | shape run on CPU | substituted on CPU | config "
             "| CPU |", "|---" * 8 + "|"]  # fmt: skip
    for row in rows:
        gpu = row.get("gpu", {})
        gpu_words = f"**{gpu.get('verdict', '-')}**" + (f": {gpu['why']}" if gpu.get("why") else "")
        cpu = f"**{row.get('verdict', '-')}**: {row.get('why', '')}"
        if row.get("run") not in (None, row["recipe"]):
            cpu += f" (the run of `{row['run']}`)"
        cells = [f"`{row['recipe']}`", row.get("setting", "-"), row.get("recipe_shape", "-"), gpu_words,
                 row.get("shape", "-"), "; ".join(row.get("substituted", [])) or "-",
                 "; ".join(row.get("config", [])) or "-", cpu]  # fmt: skip
        lines.append("| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |")
    return lines


def not_built(universe: list[dict]) -> list[str]:
    """What could not be built here (so is not known to be a MoE config), counted by why: the check's limits apart
    from the recipes' own failures."""
    lines = []
    for limit, words in ((True, "the check's limit"), (False, "the recipe's own failure here")):
        why = Counter(row["why"] for row in universe if not row["built"] and bool(row.get("limit")) == limit)
        if why:
            total = sum(why.values())
            lines.append(f"not built ({words}): {total}: " + "; ".join(f"{n} x {w}" for w, n in why.most_common()))
    return lines


def summary(rows: list[dict], runs: int) -> list[str]:
    """The counts: configs and runs, the GPU verdicts (by rule), the CPU verdicts (GPU-only pieces apart)."""
    gpu = Counter(row.get("gpu", {}).get("verdict", "not judged") for row in rows)
    rules = Counter(rule for row in rows for rule in row.get("gpu", {}).get("rules", []))
    cpu = Counter(row.get("verdict", "not checked") for row in rows)
    pieces = Counter(row["gpu_only"] for row in rows if row.get("gpu_only"))
    families = Counter(row.get("family", "-") for row in rows)
    both = sum(row.get("verdict") == "bitwise" and row.get("gpu", {}).get("verdict") == "refused" for row in rows)
    lines = [f"{len(rows)} configs, {runs} runs",
             f"GPU, as the recipe is: {gpu['runs']} runs, {gpu['refused']} refused"
             + (f" ({', '.join(f'{rule} {n}' for rule, n in rules.most_common())})" if rules else ""),
             "CPU: " + ", ".join(f"{cpu[v]} {v}" for v in CPU_VERDICTS)
             + (f" (GPU-only: {', '.join(f'{p} {n}' for p, n in pieces.most_common())})" if pieces else ""),
             f"bitwise on CPU but refused on GPU: {both}",
             "families: " + ", ".join(f"{f} {n}" for f, n in sorted(families.items()))]  # fmt: skip
    failed_elsewhere = cpu["failed"] - sum(pieces.values())
    lines.append(f"recipes: {cpu['bitwise']} bitwise, {cpu['refused']} refused, {cpu['differs']} differ, "
                 f"{failed_elsewhere} failed, {cpu['not checked']} not checked of {len(rows)}")  # fmt: skip
    return lines


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipes", nargs="*", help="recipe config functions: recipes.NAME, perf_recipes.NAME or NAME")
    parser.add_argument("--all", action="store_true", help="every MoE config with expert parallelism above 1")
    parser.add_argument("--list", action="store_true", help="print the universe with each recipe's setting and stop")
    parser.add_argument("--no_delay_wgrad", action="store_true", help="the overlap without delayed wgrad")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--markdown", type=Path, help="also write the table and the summary here")
    args = parser.parse_args(argv)
    if not (args.recipes or args.all or args.list):
        parser.error("give recipe names, --all or --list")
    return args


def listing(universe: list[dict]) -> list[str]:
    """``--list``: the universe, one line each, then what the check could not build."""
    lines = [f"{row['recipe']}  {row['setting']}" for row in universe if row.get("moe_ep")]
    limits = [row for row in universe if not row["built"] and row.get("limit")]
    lines += [f"# not built, the check's limit: {row['recipe']}: {row['why']}" for row in limits]
    failing = [row for row in universe if not row["built"] and not row.get("limit")]
    lines += [f"# not built, the recipe fails here: {row['recipe']}: {row['why']}" for row in failing]
    return lines


def chosen(args, universe: list[dict]) -> tuple[list[dict], list[str]]:
    """The rows to check, and one error line per name that is not a recipe."""
    from tests.functional_tests.recipe_check.universe import resolve_name

    by_name = {row["recipe"]: row for row in universe}
    if args.all:
        return [row for row in universe if row.get("moe_ep")], []
    rows, errors = [], []
    for name in args.recipes:
        qualified, why = resolve_name(name, list(by_name))
        if why:
            errors.append(f"error: {why}")
        else:
            rows.append(by_name[qualified])
    return rows, errors


def run_all(trees: Trees, rows: list[dict], delay_wgrad: bool) -> int:
    """The CPU runs, one per key (with the plugin, or the patch where the run needs it); each row gets its run's
    verdict. Returns the number of runs."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row.get("key") or row["recipe"], []).append(row)
    firsts = {members[0]["recipe"]: members for members in groups.values()}
    started, done = time.monotonic(), [0]

    def report(result: dict) -> None:
        done[0] += 1
        members = firsts[result["recipe"]]
        for row in members:
            row.update({k: v for k, v in result.items() if k not in ("recipe", "config", "substituted")},
                       run=result["recipe"])  # fmt: skip
        print(f"[{done[0]}/{len(groups)}, {time.monotonic() - started:.0f} s] {result['recipe']} ({len(members)} "
              f"configs): {result.get('verdict')}: {result.get('why', '')}", file=sys.stderr, flush=True)  # fmt: skip

    runnable = [name for name, members in firsts.items() if members[0]["built"] and "key" in members[0]]
    for name, members in firsts.items():
        if name not in runnable:
            first = members[0]
            report({"recipe": name, "verdict": "not checked" if first.get("limit") else "failed", "why": first["why"]})
    for patched in (False, True):
        names = [name for name in runnable if bool(firsts[name][0].get("needs_patch")) == patched]
        if names:
            cpu_runs(trees, names, patched, delay_wgrad, report)
    return len(groups)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="recipe-check-") as scratch:
        trees = Trees(Path(scratch))
        universe = trees.worker(trees.plugin, "--universe", timeout=3600)
        if not isinstance(universe, list):
            print(f"error: could not build the recipes' universe: {universe.get('why')}", file=sys.stderr)
            return 1
        if args.list:
            print("\n".join(listing(universe)))
            return 0
        rows, errors = chosen(args, universe)
        if errors:
            print("\n".join(errors), file=sys.stderr)
            return 2
        runs = run_all(trees, rows, not args.no_delay_wgrad)
    lines = table(rows) + [""] + (not_built(universe) if args.all else []) + summary(rows, runs)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n")
    bad = [row for row in rows if row.get("verdict") in ("differs", "not checked")]
    bad += [row for row in rows if row.get("verdict") == "failed" and not row.get("gpu_only")]
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
