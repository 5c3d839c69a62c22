"""Check Megatron-Bridge 0.6.2's own MoE recipes against this project's EP overlap, on CPU, before a cluster runs them.

    make recipe-check RECIPES="perf_recipes.qwen3_30b_a3b_pretrain_8gpu_h100_bf16_config ..."
    make recipe-check RECIPES=--all          # every MoE config with expert parallelism above 1
    python tools/recipe_check.py --list      # that universe, with each recipe's own overlap setting
    python tools/recipe_check.py NAME ... [--no_delay_wgrad] [--json rows.json] [--markdown table.md]
    python tools/recipe_check.py --resume rows.json   # an interrupted run goes on: its finished rows are kept
    python tools/recipe_check.py --all --gpu_only     # the GPU verdicts beside Megatron-Core's plan's, no CPU run

The universe is found by built config: every config function of ``megatron.bridge.recipes`` and
``megatron.bridge.perf_recipes`` that builds a MoE model with ``expert_model_parallel_size > 1``, whatever its overlap
flag says. A name is qualified by its package (``recipes.NAME`` or ``perf_recipes.NAME``); a bare name is taken when
one package has it. Each config gets three verdicts:

* **GPU, as the recipe is**: this project's rules on the unshrunk config with the overlap on (``runs``, or
  ``refused`` with the rules' names);
* **Megatron-Core's plan**: what Megatron-Core 0.19.2's own combined-1F1B plan does with the same config, by its and
  Bridge's own checks run on copies of it (``runs``, ``refused`` with the check's message, or ``recipe fails`` where
  the recipe fails them with the overlap off; ``recipe_check/mcore_plan.py``). The summary puts it beside ours, 2 x 2;
  ``--gpu_only`` prints these two verdicts alone, with no CPU run;
* **CPU**: shrunk with its structure kept, the CPU substitutions named, trained 2 steps by stock Bridge's own
  ``train()`` overlap off and on (``bitwise``, ``refused``, ``differs`` with the first tensor, ``failed`` naming the
  GPU-only piece it needs, or ``not checked`` where the check itself could not: counted apart).

And the **predicted gain**: the planner's speedup for the recipe as it is with the overlap on, on the hardware its name
says (``scripts/performance/utils/plan_recipe.py``, priced where the worker builds the config), or ``not priced`` and
why. A prediction, not a measurement; a pricing that fails never changes a verdict or the exit status.

Configs whose CPU run would be the same (shrunk structure, substitutions) share one run; every config keeps its row.
``tests/functional_tests/recipe_check/`` says exactly what runs. Exit status 0 only when nothing differs and every
failure names a GPU-only piece; 2, one line each and before any run, for a name that is not a MoE recipe with expert
parallelism, an output path that cannot be written or a ``--resume`` file that is not this check's. A name given
twice runs once. A progress line per run goes to stderr. The first run builds a scratch venv under
``build/stock-bridge/``; no run reaches the Hugging Face hub.

SIGINT or SIGTERM stops every worker and rank the check started (each worker leads its own process group), removes
the scratch folder, writes the rows finished so far (the table, ``--markdown`` and ``--json``, marked partial) and
exits 130 or 143 with one line saying how far it got. ``--resume FILE`` runs what FILE lacks (the names FILE was
asked unless others are given) and writes the whole into FILE unless ``--json`` names another.
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
sys.path.insert(0, str(ROOT))
from tests.functional_tests.recipe_check import rows_file, stopping  # noqa: E402

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
        from tests.functional_tests import stock_bridge

        self.stock_bridge, self.scratch = stock_bridge, scratch
        self.live: list[subprocess.Popen] = []  # the workers started and not yet stopped
        self.python = stock_bridge.scratch_env()
        self.plugin = stock_bridge.plugin_tree(self.python)
        self._patched = None

    @property
    def patched(self) -> Path:
        if self._patched is None:
            shutil.rmtree(self.scratch / "patched", ignore_errors=True)
            self._patched = self.stock_bridge.patched_tree(self.scratch / "patched")
        return self._patched

    def start(self, tree: Path, out: Path, *args: str, log: Path) -> subprocess.Popen:
        """The worker on ``tree``, in the background, in a process group of its own (its ranks join it)."""
        with stopping.held():  # a signal now is answered once the worker is on the list to stop
            process = self.stock_bridge.start(self.python, tree, WORKER, str(out), *args, log=log)
            self.live.append(process)
        return process

    def stop(self, process: subprocess.Popen | None = None) -> None:
        """``process`` (else every worker still on the list) and every rank it started."""
        for each in [process] if process else list(self.live):
            stopping.stop_group(each)
            self.live.remove(each)

    def worker(self, tree: Path, *args: str, timeout: int = 1200):
        out, log = self.scratch / "worker.json", self.scratch / "worker.log"
        out.unlink(missing_ok=True)
        process = self.start(tree, out, *args, log=log)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"verdict": "failed", "why": f"timed out after {timeout} s"}
        finally:
            self.stop(process)
        if process.returncode != 0 or not out.exists():
            lines = log.read_text().strip().splitlines() or ["(no output)"]
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
        worker = trees.start(tree, out, *args, log=log)
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
        try:
            worker.wait(timeout=30)  # it has written its rows
        except subprocess.TimeoutExpired:
            pass
        trees.stop(worker)  # and a rank a dead worker left behind
        remaining = [name for name in remaining if name not in results]
        if remaining:  # the worker died in the run of remaining[0]
            last = (log.read_text().strip().splitlines() or ["(no output)"])[-1]
            why = f"the check could not finish its worker (exit {worker.returncode}): {last}"
            results[remaining[0]] = {"recipe": remaining[0], "verdict": "not checked", "why": why}
            report(results[remaining[0]])
            remaining = remaining[1:]
    return results


def gain_words(row: dict) -> str:
    """The planner's predicted gain for the row (its speedup and hardware), or ``not priced`` and why."""
    gain = row.get("gain")
    if gain is None:
        return "not priced: not built here" if row.get("built") is False else "-"
    if "why" in gain:
        return f"not priced: {gain['why']}"
    guessed = any(note.startswith("its name names no GPU") for note in gain.get("notes", []))
    return f"{gain['speedup']:.2f}x ({gain['gpus']} x {gain['profile']}{', its name names no GPU' if guessed else ''})"


def table(rows: list[dict]) -> list[str]:
    """The rows as a Markdown table."""
    lines = ["| recipe | setting | recipe's shape | GPU, as it is | Megatron-Core's plan | predicted gain "
             "| shape run on CPU | substituted on CPU | config | CPU |", "|---" * 10 + "|"]  # fmt: skip
    for row in rows:
        gpu, mcore = row.get("gpu", {}), row.get("mcore", {})
        gpu_words = f"**{gpu.get('verdict', '-')}**" + (f": {gpu['why']}" if gpu.get("why") else "")
        mcore_words = f"**{mcore.get('verdict', '-')}**" + (f": {mcore['why']}" if mcore.get("why") else "")
        cpu = f"**{row.get('verdict', '-')}**: {row.get('why', '')}"
        if row.get("run") not in (None, row["recipe"]):
            cpu += f" (the run of `{row['run']}`)"
        cells = [f"`{row['recipe']}`", row.get("setting", "-"), row.get("recipe_shape", "-"), gpu_words, mcore_words,
                 gain_words(row), row.get("shape", "-"), "; ".join(row.get("substituted", [])) or "-",
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


BESIDE = ("both run", "ours runs, Megatron-Core's refuses", "Megatron-Core's runs, ours refuses", "both refuse")


def beside_mcore(rows: list[dict]) -> list[str]:
    """Our GPU verdict beside Megatron-Core's own plan's, as a Markdown 2 x 2 (performance recipes, recipes, all);
    a recipe that fails Megatron-Core's or Bridge's checks with the overlap off is counted apart (neither plan runs
    it), as is a row either verdict could not judge."""
    cells: Counter = Counter()
    for row in rows:
        ours, theirs = row.get("gpu", {}).get("verdict"), row.get("mcore", {}).get("verdict")
        if theirs == "recipe fails":
            cell = "the recipe itself fails with the overlap off"
        elif ours not in ("runs", "refused") or theirs not in ("runs", "refused"):
            cell = "not judged"
        else:
            cell = BESIDE[2 * (ours == "refused") + (theirs == "refused")]
        for column in ("perf" if row["recipe"].startswith("perf_recipes.") else "recipes", "all"):
            cells[cell, column] += 1
    lines = ["| ours (GPU, as the recipe is) / Megatron-Core 0.19.2's plan | performance recipes | recipes | all |",
             "|---|---|---|---|"]  # fmt: skip
    for cell in BESIDE + ("the recipe itself fails with the overlap off", "not judged"):
        if cell in BESIDE or cells[cell, "all"]:
            lines.append(f"| {cell} | {cells[cell, 'perf']} | {cells[cell, 'recipes']} | {cells[cell, 'all']} |")
    why = Counter(row["mcore"]["why"].split(" (")[0][:100] for row in rows
                  if row.get("mcore", {}).get("verdict") in ("refused", "recipe fails"))  # fmt: skip
    if why:
        lines.append(
            "Megatron-Core's plan refuses (or the recipe fails): "
            + "; ".join(f"{n} x {w}" for w, n in why.most_common())
        )
    return lines


def summary(rows: list[dict], with_cpu: bool = True) -> list[str]:
    """The counts: configs and runs, the GPU verdicts (by rule) beside Megatron-Core's plan's, the CPU verdicts
    (GPU-only pieces apart); ``with_cpu=False`` (``--gpu_only``): the verdicts decided from the config alone."""
    runs = len({row.get("run", row["recipe"]) for row in rows})
    gpu = Counter(row.get("gpu", {}).get("verdict", "not judged") for row in rows)
    rules = Counter(rule for row in rows for rule in row.get("gpu", {}).get("rules", []))
    cpu = Counter(row.get("verdict", "not checked") for row in rows)
    pieces = Counter(row["gpu_only"] for row in rows if row.get("gpu_only"))
    families = Counter(row.get("family", "-") for row in rows)
    both = sum(row.get("verdict") == "bitwise" and row.get("gpu", {}).get("verdict") == "refused" for row in rows)
    lines = [
        f"{len(rows)} configs" + (f", {runs} runs" if with_cpu else ""),
        f"GPU, as the recipe is: {gpu['runs']} runs, {gpu['refused']} refused"
        + (f" ({', '.join(f'{rule} {n}' for rule, n in rules.most_common())})" if rules else ""),
    ]
    lines += beside_mcore(rows)
    if not with_cpu:
        return lines + ["families: " + ", ".join(f"{f} {n}" for f, n in sorted(families.items()))]
    lines += ["CPU: " + ", ".join(f"{cpu[v]} {v}" for v in CPU_VERDICTS)
             + (f" (GPU-only: {', '.join(f'{p} {n}' for p, n in pieces.most_common())})" if pieces else ""),
             f"bitwise on CPU but refused on GPU: {both}",
             "families: " + ", ".join(f"{f} {n}" for f, n in sorted(families.items()))]  # fmt: skip
    gains = sorted(row["gain"]["speedup"] for row in rows if "speedup" in row.get("gain", {}))
    if gains:
        lines.append(f"predicted gain (the planner, overlap on as the recipe is): {len(gains)} priced, median "
                     f"{gains[len(gains) // 2]:.2f}x, {sum(g >= 1.1 for g in gains)} at 1.10x or more, "
                     f"{sum(g < 1.03 for g in gains)} under 1.03x; {len(rows) - len(gains)} not priced")  # fmt: skip
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
    parser.add_argument(
        "--gpu_only",
        "--gpu-only",
        action="store_true",
        help="the verdicts decided from the config (ours and Megatron-Core's plan's), no CPU run",
    )
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--markdown", type=Path, help="also write the table and the summary here")
    parser.add_argument("--resume", type=Path, help="keep this --json file's finished rows; run the rest")
    args = parser.parse_args(argv)
    if not (args.recipes or args.all or args.list or args.resume):
        parser.error("give recipe names, --all, --list or --resume")
    return args


def resumed(args) -> tuple[dict[str, dict], list[str]]:
    """``--resume``: the file's finished rows (its names, unless others are given), and one error line per problem
    with the output paths. Sets ``--json`` to the resumed file unless it names another."""
    done, errors = {}, []
    if args.resume:
        try:
            done, asked = rows_file.load(args.resume, args.no_delay_wgrad)
        except rows_file.BadRowsFile as error:
            return {}, [f"error: {error}"]
        if not (args.recipes or args.all):
            args.recipes, args.all = list(asked.get("recipes") or []), bool(asked.get("all"))
        if not (args.recipes or args.all or args.list):
            errors.append(f"error: --resume {args.resume}: it does not say what was asked; fix: give names or --all")
        args.json = args.json or args.resume
    for flag, path in (("--json", args.json), ("--markdown", args.markdown)):
        why = rows_file.unwritable(flag, path) if path else None
        errors += [f"error: {why}"] if why else []
    return done, errors


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
    rows, errors = {}, []
    for name in dict.fromkeys(args.recipes):  # a name given twice (or bare and qualified) runs once
        qualified, why = resolve_name(name, list(by_name))
        if why:
            errors.append(f"error: {why}")
        elif by_name[qualified]["built"] and not by_name[qualified].get("moe_ep"):
            errors.append(f"error: {qualified}: builds no MoE model with expert_model_parallel_size above 1: the "
                          "overlap has nothing to overlap there; fix: a name from `python tools/recipe_check.py "
                          "--list`")  # fmt: skip
        else:
            rows[qualified] = by_name[qualified]
    return list(rows.values()), errors


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
            why = first.get("why", "the universe gave it no CPU run")
            report({"recipe": name, "verdict": "not checked" if first.get("limit") else "failed", "why": why})
    for patched in (False, True):
        names = [name for name in runnable if bool(firsts[name][0].get("needs_patch")) == patched]
        if names:
            cpu_runs(trees, names, patched, delay_wgrad, report)
    return len(groups)


class Run:
    """One run of the check: what it has so far, so an interrupt can still write it, and how to close it."""

    def __init__(self, args, done: dict[str, dict]):
        self.args, self.done = args, done  # done: a --resume file's finished rows
        self.rows: list[dict] | None = None  # the rows asked, once the universe is built
        self.scratch, self.trees = None, None

    def check(self) -> int:
        args = self.args
        self.scratch = Path(tempfile.mkdtemp(prefix="recipe-check-"))
        self.trees = Trees(self.scratch)
        judge = [] if args.all else ["--judge", *([] if args.list else args.recipes)]  # --list judges none
        universe = self.trees.worker(self.trees.plugin, "--universe", *judge, timeout=3600)
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
        self.rows = [self.done.get(row["recipe"], row) for row in rows]
        if args.gpu_only:  # the universe pass decided both GPU verdicts: nothing to run
            self.close()
            self.write(table(self.rows) + [""] + summary(self.rows, with_cpu=False), False)
            return 0
        run_all(self.trees, [row for row in self.rows if not rows_file.finished(row)], not args.no_delay_wgrad)
        self.close()
        self.write(table(self.rows) + [""] + (not_built(universe) if args.all else []) + summary(self.rows), False)
        bad = [row for row in self.rows if row.get("verdict") in ("differs", "not checked")]
        bad += [row for row in self.rows if row.get("verdict") == "failed" and not row.get("gpu_only")]
        return 0 if not bad else 1

    def close(self) -> None:
        """Every worker and rank stopped, the scratch folder gone (again is harmless)."""
        if self.trees is not None:
            self.trees.stop()
            stopping.reap_orphans()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def write(self, lines: list[str], partial: bool) -> None:
        print("\n".join(lines))
        args = self.args
        if args.json:
            rows = self.rows if self.rows is not None else list(self.done.values())
            asked = {"recipes": args.recipes, "all": args.all, "no_delay_wgrad": args.no_delay_wgrad,
                     "gpu_only": args.gpu_only}  # fmt: skip
            rows_file.write(args.json, rows, asked, None if self.rows is None else len(self.rows), partial)
        if args.markdown:
            args.markdown.write_text("\n".join(lines) + "\n")

    def interrupted(self, stop: stopping.Interrupted) -> int:
        """The rows finished so far, written and marked partial; one line on how far the run got."""
        if self.args.list:
            print(f"interrupted by {stop.name} while building the recipes' universe", file=sys.stderr)
            return stop.status
        rows = self.rows if self.rows is not None else list(self.done.values())
        done = [row for row in rows if rows_file.finished(row)]
        runs = len({row.get("run", row["recipe"]) for row in done})
        where = (f"after {len(done)} of {len(self.rows)} configs ({runs} runs)" if self.rows is not None
                 else f"while building the recipes' universe, {len(done)} configs done")  # fmt: skip
        partial = self.rows is None or len(done) < len(self.rows)
        self.write(table(done) + [""] + summary(done) + [f"partial: interrupted by {stop.name} {where}"], partial)
        kept = (f"their rows are above and in {self.args.json} (partial); to go on: python tools/recipe_check.py "
                f"--resume {self.args.json}" if self.args.json else "their rows are above (give --json FILE to "
                "resume from it)")  # fmt: skip
        print(f"interrupted by {stop.name} {where}: {kept}", file=sys.stderr)
        return stop.status


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    done, errors = resumed(args)
    if errors:
        print("\n".join(errors), file=sys.stderr)
        return 2
    stopping.raise_on_signals()
    stopping.adopt_orphans()
    run = Run(args, done)
    try:
        return run.check()
    except stopping.Interrupted as stop:
        run.close()  # first: nothing the check started outlives it
        return run.interrupted(stop)
    finally:
        run.close()


if __name__ == "__main__":
    sys.exit(main())
