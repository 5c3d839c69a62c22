"""Upstream's own unit tests, run against an upstream source tree as it is and with this project's patch applied.

    python tools/upstream_ci.py TREE --python VENV/bin/python [--jobs 2] [--timeout 300] [--out DIR] [FILE ...]

TREE is a Megatron-Bridge source checkout (holding ``src/`` and ``tests/unit_tests/``); the registry's sdist has no
tests. ``--python`` is an interpreter whose environment has upstream's dependencies that install on a CPU host
(``docs/training/upstream-compatibility.md`` says how we build it); it must not have either Megatron-Bridge installed,
since each run puts its own copy's ``src/`` first on the path.

What it does:
    * Selects the upstream test files that import a module the patch changes or that upstream's recipes and
      training config run through: ``training.comm_overlap``, ``training.flex_dispatcher_backend``, the files the
      stored hunks change (``training.gpt_step``, ``training.train``, ``training.setup``,
      ``models.qwen_vl.qwen3_vl_step``), ``training.config`` and ``megatron.bridge.recipes`` (or the FILEs given,
      relative to ``tests/unit_tests``).
    * Copies the tree twice into ``--out``: as it is, and with the patch ``tools/upstream.py`` makes for this very
      tree applied (it must apply; a tree the patch needs a rebase for is refused with what does not apply).
    * Runs every selected file whole in each copy, ``pytest -m "not gpu and not pleasefixme"``, at most
      ``--timeout`` seconds per file, with a Transformer Engine import stand-in on the path (upstream's
      ``peft/lora_layers.py`` imports ``transformer_engine.pytorch`` and the package ``__init__`` imports it; the
      stand-in makes every name importable and unusable). Each run writes junit XML.
    * Compares the outcomes test by test and prints the counts of both runs, every test that passes as it is and
      not with the patch (a regression), and every one that only passes with it.
    * Runs the patch's own tests (``tests/unit_tests/training/ep_overlap/``, :func:`upstream.patch_tests`, and the
      bug fixes' tests the series carries) in the patched copy, the same way, and prints their counts and every
      failure. Where the interpreter has no lab (``ep_overlap_lab``), those marked ``lab`` skip, as in upstream's CI.

Exit status: 1 when there is a regression or one of the patch's own tests fails, else 0.
"""

import argparse
import ast
import functools
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import upstream  # noqa: E402

TOUCHED = (
    "megatron.bridge.training.comm_overlap",
    "megatron.bridge.training.flex_dispatcher_backend",
    "megatron.bridge.training.gpt_step",
    "megatron.bridge.training.train",
    "megatron.bridge.training.setup",
    "megatron.bridge.models.qwen_vl.qwen3_vl_step",
    "megatron.bridge.training.config",
    "megatron.bridge.recipes",
)
# Megatron-Bridge's peft/lora_layers.py imports Transformer Engine unguarded; Megatron-Core and peft ask whether it
# is there and must be told it is not. So a finder (installed at start-up, as sitecustomize) serves a stand-in to
# importers inside megatron.bridge only, where every name imports and none works; anyone else finds nothing.
TE_STAND_IN = '''"""Transformer Engine import stand-in for upstream's tests on a host without it (upstream_ci.py)."""

import importlib.abc
import importlib.machinery
import importlib.util
import sys


class _Names(type):
    def __getattr__(cls, name):  # te.ops.Sequential in an annotation: a name of a name
        if name.startswith("__"):
            raise AttributeError(name)
        return _Names(name, (_Missing,), {})


class _Missing(metaclass=_Names):
    def __init__(self, *args, **kwargs):
        raise ImportError("Transformer Engine is not installed (import stand-in)")


def _name(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Names(name, (_Missing,), {})


def _importer():
    """The module asking: the first frame outside this file and outside importlib."""
    frame = sys._getframe(1)
    while frame is not None and (
        frame.f_globals.get("__name__") == __name__ or frame.f_globals.get("__name__", "").startswith("importlib")
    ):
        frame = frame.f_back
    return frame.f_globals.get("__name__", "") if frame is not None else ""


class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] != "transformer_engine" or not _importer().startswith("megatron.bridge"):
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__path__, module.__getattr__ = [], _name


if importlib.util.find_spec("transformer_engine") is None:  # a real Transformer Engine is left alone
    sys.meta_path.insert(0, _StandIn())
'''


def _imported(path: Path) -> set[str]:
    """Every module a test file imports, a ``from package import name`` counted as ``package.name`` too."""
    try:
        tree = ast.parse(path.read_text())
    except SyntaxError:
        return set()
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def select_tests(tree: Path) -> list[str]:
    """The test files (relative to ``tests/unit_tests``) that import what :data:`TOUCHED` names."""
    root = tree / "tests" / "unit_tests"
    return sorted(
        str(path.relative_to(root))
        for path in root.rglob("test_*.py")
        if any(module == t or module.startswith(t + ".") for module in _imported(path) for t in TOUCHED)
    )


def _copy(tree: Path, into: Path) -> Path:
    """The tree without its git data and docs (tests import from src/, scripts/, examples/ and the rest)."""
    shutil.copytree(tree, into, symlinks=True, ignore=shutil.ignore_patterns(".git", "docs"))
    return into


def prepare(tree: Path, out: Path) -> dict[str, Path]:
    """The two copies (``as-is`` and ``patched``) and the stand-in folder under ``out``."""
    rebase = upstream.hunks_needing_rebase(upstream.make_patch(tree), tree)
    if rebase:
        raise SystemExit(f"error: the patch does not apply to {tree}: {rebase}")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    copies = {"as-is": _copy(tree, out / "as-is"), "patched": _copy(tree, out / "patched")}
    patch = upstream.make_patch(copies["patched"])
    subprocess.run(["git", "apply", "-"], cwd=copies["patched"], input=patch, text=True, check=True)
    (out / "stand-ins").mkdir()
    (out / "stand-ins" / "sitecustomize.py").write_text(TE_STAND_IN)
    return copies | {"stand-ins": out / "stand-ins"}


def run_file(python: str, copy: Path, stand_ins: Path, test: str, *, timeout: int, results: Path) -> Path:
    """One test file, whole, in one copy; returns its junit XML (a timeout or crash is one failed pseudo-test)."""
    xml = results / (test.replace("/", "__") + ".xml")
    env = {"PYTHONPATH": f"{copy / 'src'}:{copy}:{stand_ins}", "PATH": "/usr/bin:/bin", "HOME": str(results)}
    command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu and not pleasefixme",
               f"--junitxml={xml}", f"tests/unit_tests/{test}"]  # fmt: skip
    try:
        subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        xml.unlink(missing_ok=True)
    if not xml.exists():
        xml.write_text(f'<testsuites><testsuite><testcase classname="{test}" name="(whole file)">'
                       f"<failure message='timed out or crashed'/></testcase></testsuite></testsuites>")  # fmt: skip
    return xml


def outcomes(xml: Path) -> dict[str, str]:
    """test id -> passed / failed / skipped, from one junit XML."""
    found = {}
    for case in ElementTree.parse(xml).getroot().iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        found[test] = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
    return found


def run_all(python: str, copies: dict[str, Path], tests: list[str], timeout: int, jobs: int) -> dict[str, dict]:
    runs: dict[str, dict[str, str]] = {}
    for name in ("as-is", "patched"):
        results = copies[name].parent / f"junit-{name}"
        results.mkdir(exist_ok=True)
        one = functools.partial(run_file, python, copies[name], copies["stand-ins"], timeout=timeout, results=results)
        with ThreadPoolExecutor(jobs) as pool:
            runs[name] = {test: state for xml in pool.map(one, tests) for test, state in outcomes(xml).items()}
    return runs


def own_tests() -> list[str]:
    """The patch's own test files (the feature's, then the bug fixes'), relative to ``tests/unit_tests``."""
    root = Path("tests/unit_tests")
    fixes = [Path(f) for part in upstream.SERIES for f in part.files]
    return [str(p.relative_to(root)) for p in [*upstream.patch_tests(), *fixes] if p.name.startswith("test_")]


def run_own(python: str, copies: dict[str, Path], timeout: int, jobs: int) -> dict[str, str]:
    results = copies["patched"].parent / "junit-own"
    results.mkdir(exist_ok=True)
    one = functools.partial(run_file, python, copies["patched"], copies["stand-ins"], timeout=timeout, results=results)
    with ThreadPoolExecutor(jobs) as pool:
        return {test: state for xml in pool.map(one, own_tests()) for test, state in outcomes(xml).items()}


def report_own(states: dict[str, str]) -> int:
    counts = {state: sum(1 for s in states.values() if s == state) for state in ("passed", "failed", "skipped")}
    print(
        f"the patch's own tests, patched: {len(own_tests())} files, "
        + ", ".join(f"{n} {s}" for s, n in counts.items())
    )
    failed = sorted(t for t, s in states.items() if s == "failed")
    print("".join(f"  failed: {t}\n" for t in failed), end="")
    return 1 if failed else 0


def report(runs: dict[str, dict[str, str]], files: int) -> int:
    before, after = runs["as-is"], runs["patched"]
    for name, states in runs.items():
        counts = {state: sum(1 for s in states.values() if s == state) for state in ("passed", "failed", "skipped")}
        print(f"{name}: {files} files, " + ", ".join(f"{n} {state}" for state, n in counts.items()))
    regressions = sorted(t for t, s in before.items() if s == "passed" and after.get(t) != "passed")
    fixed = sorted(t for t, s in after.items() if s == "passed" and before.get(t) != "passed")
    print(f"regressions (pass as it is, not with the patch): {len(regressions)}")
    print("".join(f"  {t} ({after.get(t, 'missing')})\n" for t in regressions), end="")
    print(f"pass only with the patch: {len(fixed)}")
    print("".join(f"  {t}\n" for t in fixed), end="")
    return 1 if regressions else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="upstream_ci.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("tree", type=Path, help="a Megatron-Bridge source checkout")
    parser.add_argument("files", nargs="*", help="test files relative to tests/unit_tests (default: the selection)")
    parser.add_argument("--python", required=True, help="an interpreter with upstream's CPU dependencies")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test file (default 300)")
    parser.add_argument("--jobs", type=int, default=2, help="test files run at once (default 2)")
    parser.add_argument("--out", type=Path, default=None, help="where the copies and junit XML go (default: temp)")
    args = parser.parse_intermixed_args(argv)  # files may follow the options
    if not (args.tree / "tests" / "unit_tests").is_dir() or not (args.tree / upstream.PACKAGE).is_dir():
        print(
            f"error: {args.tree}: not a Megatron-Bridge source checkout (src/ and tests/unit_tests/)", file=sys.stderr
        )
        return 2
    missing = [name for name in args.files if not (args.tree / "tests" / "unit_tests" / name).is_file()]
    for name in missing:
        print(f"error: {name}: no such file under {args.tree / 'tests' / 'unit_tests'}", file=sys.stderr)
    if missing:
        return 2
    tests = args.files or select_tests(args.tree)
    with tempfile.TemporaryDirectory() as scratch:
        copies = prepare(args.tree, args.out or Path(scratch) / "upstream-ci")
        print(f"{len(tests)} test files; copies under {copies['as-is'].parent}", flush=True)
        regressed = report(run_all(args.python, copies, tests, args.timeout, args.jobs), len(tests))
        return report_own(run_own(args.python, copies, args.timeout, args.jobs)) or regressed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
