"""Megatron-Bridge 0.6.2 from the package registry, and the two ways this project ships against it.

    python tools/upstream.py plugin               # dist/megatron_bridge_ep_overlap-*.whl: installs beside upstream
    python tools/upstream.py patch                # dist/megatron-bridge-ep-overlap/000N-*.patch: a patch series
                                                  # for a fork of 0.6.2, and all of it in dist/...-ep-overlap.patch
    python tools/upstream.py patch --against DIR  # the series for the upstream source tree DIR (e.g. a checkout of
                                                  # main), and which hunks of the 0.6.2 series need a rebase there

The series (``tools/upstream_series.py``, ``git format-patch`` form, one commit each with ``git am``) is what a
maintainer reviews one piece at a time: first the upstream bug fixes it carries, each on its own with its test
(``gpt_step``: the loss mask to the plain forward of MTP models; the packed-sequence parameters to the plan), then the
feature, then the hunks of upstream files only the feature needs (``qwen3_vl_step``; ``train.py`` and ``setup.py``
for the plain 1F1B pipeline). Each part changes only the paths its subject names.

The feature is the payload, what a Bridge training step calls: this project's modules under ``src/megatron/bridge``
(the plugin's entry point ``training/ep_overlap_config.py`` as the alias in ``tools/upstream_files/``: on the patched
tree ``CommOverlapConfig`` checks every rule itself, and a recipe written for the plugin runs unchanged), its
changes to upstream's ``training/comm_overlap.py`` and ``training/flex_dispatcher_backend.py`` (whole files here,
supersets of upstream's), and its tests (:func:`patch_tests`: ``tests/unit_tests/training/ep_overlap/``, in
upstream's layout, the lab's launcher in ``local_ranks.py``'s place). Changes to upstream files this project does not
ship are stored as diffs under ``tools/upstream_hunks/``; files shipped whole from elsewhere (the fixes' tests) under
``tools/upstream_files/``. The lab (``src/ep_overlap_lab``: the reference engine and model, the planner, the launcher)
stays out. ``make patch`` prints the added lines per patch and by directory. It is made by default against the 0.6.2
sources (the registry's sdist, fetched here into build/, never committed), and committed in order with ``git am`` onto
a fresh unpack before it is written. It passes upstream's repository checks: every new Python file starts with the
license header upstream's copyright check expects (added here, so the project's own files stay as they are), and
upstream's two files keep theirs.
"""

import argparse
import ast
import collections
import difflib
import fnmatch
import functools
import shutil
import subprocess
import sys
import tarfile
import tempfile
from datetime import date
from pathlib import Path

from upstream_series import SERIES, Part

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.6.2"
CACHE = ROOT / "build" / f"megatron-bridge-{VERSION}"
PATCH = ROOT / "dist" / "megatron-bridge-ep-overlap.patch"
PACKAGE = Path("src/megatron/bridge")
TESTS = Path("tests/unit_tests/training/ep_overlap")
# Upstream has no lab: the patch ships the lab's launcher as the tests' own (the file here only re-exports it).
TEST_SUPPORT = {TESTS / "local_ranks.py": Path("src/ep_overlap_lab/multiprocess.py")}
# Checks of this repository's own layout, the lab's included: nothing upstream's tree could answer.
PROJECT_ONLY_TESTS = {TESTS / "test_layout.py"}
HUNKS = ROOT / "tools" / "upstream_hunks"
# Shipped from another file: the plugin's entry point subclasses stock CommOverlapConfig to add what the patched
# CommOverlapConfig does itself, so the patch ships it as an alias of that class.
# The series' bug fixes ship their tests from there too, at upstream's path.
SHIPPED_FROM = {PACKAGE / "training" / "ep_overlap_config.py": Path("tools/upstream_files/ep_overlap_config.py")} | {
    Path(f): Path("tools/upstream_files") / f for part in SERIES for f in part.files
}
LICENSE_HEADER = f"""# Copyright (c) {date.today().year}, NVIDIA CORPORATION.  All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", *args], check=True, capture_output=True, text=True)


def upstream_wheel() -> Path:
    """The registry's megatron-bridge wheel (cached under build/)."""
    found = sorted(CACHE.glob("megatron_bridge-*.whl"))
    if not found:
        _pip("download", "--no-deps", "--only-binary=:all:", "-d", str(CACHE), f"megatron-bridge=={VERSION}")
        found = sorted(CACHE.glob("megatron_bridge-*.whl"))
    return found[0]


def upstream_sdist() -> Path:
    """The registry's megatron-bridge source distribution (cached under build/)."""
    found = sorted(CACHE.glob("megatron_bridge-*.tar.gz"))
    if not found:
        # Its build requirements (torch among them) are this venv's, so no isolated build environment.
        _pip("download", "--no-deps", "--no-binary=:all:", "--no-build-isolation", "-d", str(CACHE),
             f"megatron-bridge=={VERSION}")  # fmt: skip
        found = sorted(CACHE.glob("megatron_bridge-*.tar.gz"))
    return found[0]


def unpack_sources(into: Path) -> Path:
    """A fresh unpack of the 0.6.2 sources; returns its root (holding ``src/``)."""
    with tarfile.open(upstream_sdist()) as archive:
        archive.extractall(into, filter="data")
    return next(into.glob("megatron_bridge-*"))


def build_plugin(out: Path = ROOT / "dist") -> Path:
    """The plugin wheel (setup.py leaves upstream's two files out of it)."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("megatron_bridge_ep_overlap-*.whl"):
        old.unlink()
    _pip("wheel", "--no-deps", "-w", str(out), str(ROOT))
    return next(out.glob("megatron_bridge_ep_overlap-*.whl"))


def _leading_comments(lines: list[str]) -> list[str]:
    """The comment block a file starts with (upstream's license header), with the blank lines after it."""
    end = 0
    while end < len(lines) and lines[end].startswith("#"):
        end += 1
    while end and end < len(lines) and not lines[end].strip():
        end += 1
    return lines[:end]


def as_shipped(relative: Path, upstream_root: Path) -> list[str]:
    """Our file as the patch ships it: with upstream's own header where upstream has the file, else with the license
    header upstream's copyright check expects (a Python file already starting with one is left as it is)."""
    source = TEST_SUPPORT.get(relative) or SHIPPED_FROM.get(relative, relative)
    ours = (ROOT / source).read_text().splitlines(keepends=True)
    if relative.suffix != ".py" or (ours and ours[0].startswith("# Copyright")):
        return ours  # test data (a golden file) is shipped as it is
    theirs = upstream_root / relative
    header = _leading_comments(theirs.read_text().splitlines(keepends=True)) if theirs.exists() else []
    header = header or [*LICENSE_HEADER.splitlines(keepends=True), "\n"]
    return header + ours if ours else [line for line in header if line.strip()]  # no blank line ends an empty file


def _diff(relative: Path, upstream_root: Path) -> str:
    ours = as_shipped(relative, upstream_root)
    theirs_path = upstream_root / relative
    theirs = theirs_path.read_text().splitlines(keepends=True) if theirs_path.exists() else []
    if ours == theirs:
        return ""
    header = f"diff --git a/{relative} b/{relative}\n"
    if not theirs:
        header += "new file mode 100644\n"
    lines = difflib.unified_diff(theirs, ours, "/dev/null" if not theirs else f"a/{relative}", f"b/{relative}", n=3)
    text = "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)
    return header + text


def _module_level_imports(path: Path) -> list[tuple[str, int]]:
    """(module, level) of the imports a module runs when it is imported (not those inside its functions)."""
    found, todo = [], list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            found += [(alias.name, 0) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found += [(node.module or "", node.level)] + [
                (f"{node.module}.{a.name}" if node.module else a.name, node.level) for a in node.names
            ]
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            todo += [child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)]
    return found


def patch_tests() -> list[Path]:
    """The test files the patch carries (and the golden files they read): each file of :data:`TESTS` that, imported,
    imports only what upstream's tree with the patch has (Megatron-Bridge, Megatron-Core, torch, third-party
    packages, and the directory's own modules that do the same); the launcher counts as the lab's source it ships
    as. A test that reaches the lab only inside its functions is marked ``lab`` (the directory's conftest skips it
    where the lab is not installed)."""
    folder = ROOT / TESTS
    ours = {p.stem for p in folder.glob("*.py")}

    def local(name: str, level: int) -> str | None:
        first = name.split(".")[0]
        return first if level == 1 and first in ours else None

    def foreign(name: str, level: int) -> bool:
        return (level == 0 and name.split(".")[0] in ("ep_overlap_lab", "tests", "scripts", "utils")) or level > 1

    shipped: dict[str, bool] = {}

    def ships(stem: str, seen: frozenset = frozenset()) -> bool:
        if stem not in shipped:
            path = folder / f"{stem}.py"
            if TESTS / path.name in TEST_SUPPORT:
                shipped[stem] = True
            else:
                imports = _module_level_imports(path)
                shipped[stem] = not any(foreign(n, lv) for n, lv in imports) and all(
                    ships(m, seen | {stem}) for n, lv in imports if (m := local(n, lv)) and m not in seen | {stem}
                )
        return shipped[stem]

    tests = {TESTS / f"{stem}.py" for stem in ours if ships(stem)} - PROJECT_ONLY_TESTS
    read = "".join((ROOT / test).read_text() for test in tests)
    data = {p.relative_to(ROOT) for p in (folder / "golden").glob("*.txt") if p.name in read}  # what they read
    return sorted(tests | data)


def added_lines(patch: str) -> dict[str, int]:
    """The lines a patch adds, by the directory of the file it adds them to (``src/`` without its package prefix)."""
    counts: collections.Counter = collections.Counter()
    target = None
    for line in patch.splitlines():
        if line.startswith("+++ "):
            target = Path(line[6:].strip())
        elif line.startswith("+") and target is not None:
            folder = target.parent
            counts[str(folder.relative_to(PACKAGE) if folder.is_relative_to(PACKAGE) else folder)] += 1
    return dict(sorted(counts.items()))


def payload_files() -> list[Path]:
    """The feature's files: every Python file of this project's package and the tests it carries."""
    return sorted(p.relative_to(ROOT) for p in (ROOT / PACKAGE).rglob("*.py")) + patch_tests()


def _part_diff(part: Part, tree: Path) -> str:
    """What ``part`` changes, as a diff against the tree ``tree``: its files (the payload, or files shipped whole),
    then its stored hunks."""
    files = payload_files() if part.payload else [Path(f) for f in part.files]
    return "".join(_diff(relative, tree) for relative in files) + "".join((HUNKS / h).read_text() for h in part.hunks)


def _targets(diff: str) -> list[str]:
    return sorted({line[6:].strip() for line in diff.splitlines() if line.startswith(("+++ b/", "--- a/"))})


@functools.cache
def _identity() -> tuple[str, ...]:
    """The patches' author: whoever makes them (this repository's git identity), else a placeholder."""
    identity = {"user.name": "Megatron-Bridge EP overlap", "user.email": "ep-overlap@users.noreply.github.com"}
    for key in identity:
        found = subprocess.run(["git", "-C", str(ROOT), "config", key], capture_output=True, text=True).stdout
        identity[key] = found.strip() or identity[key]
    return tuple(arg for key, value in identity.items() for arg in ("-c", f"{key}={value}"))


def _git(repo: Path, *args: str, text: str | None = None) -> str:
    return subprocess.run(["git", *_identity(), *args], cwd=repo, input=text, text=True, check=True,
                          capture_output=True).stdout  # fmt: skip


def make_series(upstream_root: Path) -> list[tuple[str, str]]:
    """The series (``tools/upstream_series.py``) against the tree ``upstream_root``: (file name, patch) per part, in
    ``git format-patch`` form, each made on top of the ones before it. A part with a stored hunk that does not apply
    there is left out (:func:`hunks_that_do_not_apply` names the hunks). Raises ValueError when a part changes a path
    its subject does not name."""
    skipped = set(hunks_that_do_not_apply(upstream_root))
    parts = [(part, _part_diff(part, upstream_root)) for part in SERIES if not skipped & set(part.hunks)]
    for part, diff in parts:
        outside = [t for t in _targets(diff) if not any(fnmatch.fnmatch(t, pattern) for pattern in part.touches)]
        if outside:
            raise ValueError(f"{part.subject!r} changes {outside}, which its subject does not name")
    with tempfile.TemporaryDirectory() as scratch:
        repo, out = Path(scratch) / "tree", Path(scratch) / "series"
        for relative in {t for _, diff in parts for t in _targets(diff)}:  # the diffs name blobs, not a commit
            if (upstream_root / relative).exists():
                (repo / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(upstream_root / relative, repo / relative)
        repo.mkdir(exist_ok=True)
        _git(repo, "init", "-q")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "--allow-empty", "-m", "upstream")
        for part, diff in parts:
            _git(repo, "apply", "--index", "-", text=diff)
            _git(repo, "commit", "-q", "-F", "-", text=f"{part.subject}\n\n{part.body}\n")
        # Whatever the maker's git config says: a/ b/ prefixes, no colour, the default diff algorithm (the counts).
        plain = ("-c", "diff.noprefix=false", "-c", "diff.mnemonicPrefix=false")
        _git(repo, *plain, "format-patch", "-q", "--no-color", "--diff-algorithm=myers", "--zero-commit",
             "--no-signature", "-o", str(out), f"HEAD~{len(parts)}")  # fmt: skip
        return [(p.name, p.read_text()) for p in sorted(out.glob("*.patch"))]


def make_patch(upstream_root: Path) -> str:
    """The whole series against the tree ``upstream_root`` in one mailbox: ``git am`` applies it patch by patch,
    ``git apply`` at once."""
    return "".join(text for _, text in make_series(upstream_root))


def stored_hunks() -> list[Path]:
    return sorted(HUNKS.glob("*.diff"))


def hunks_that_do_not_apply(tree: Path) -> list[str]:
    """The stored hunk files that do not apply to the source tree ``tree`` as they are (they need a rebase there)."""

    def applies(hunk: str) -> bool:
        targets = {line[6:].strip() for line in hunk.splitlines() if line.startswith("+++ b/")}
        return all((tree / t).exists() for t in targets) and not hunks_needing_rebase(hunk, tree)

    return [h.name for h in stored_hunks() if not applies(h.read_text())]


def build_patch(path: Path = PATCH) -> Path:
    """Writes the series against the 0.6.2 sources, one file per patch in the folder ``path`` names without its
    suffix and all of them in ``path``, after committing them in order (``git am``) onto a fresh unpack."""
    with tempfile.TemporaryDirectory() as scratch:
        series = make_series(unpack_sources(Path(scratch) / "made"))
        check_series([text for _, text in series], unpack_sources(Path(scratch) / "checked"))
    folder = path.with_suffix("")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for name, text in series:
        (folder / name).write_text(text)
    path.write_text("".join(text for _, text in series))
    return path


def check_series(patches: list[str], root: Path) -> Path:
    """Commits ``patches`` in order with ``git am`` onto the source tree ``root`` (made a git repository first if it
    is none); raises CalledProcessError where one does not apply. Returns ``root``."""
    if not (root / ".git").exists():
        _git(root, "init", "-q")
        _git(root, "add", "-A")
        _git(root, "commit", "-q", "-m", f"megatron-bridge {VERSION}")
    for patch in patches:
        _git(root, "am", "-q", "-", text=patch)
    return root


def check_applies(patch: str, root: Path | None = None) -> None:
    """Raises CalledProcessError unless ``patch`` applies cleanly to ``root`` (default: a fresh unpack of 0.6.2)."""
    with tempfile.TemporaryDirectory() as scratch:
        root = root or unpack_sources(Path(scratch))
        subprocess.run(["git", "apply", "--check", "-"], cwd=root, input=patch, text=True, check=True,
                       capture_output=True)  # fmt: skip


def hunks_needing_rebase(patch: str, tree: Path) -> dict[str, int]:
    """Per file, how many hunks of ``patch`` do not apply to the source tree ``tree`` (tried on a scratch copy of
    the files the patch touches; ``tree`` is not changed)."""
    touched = sorted({line[6:].strip() for line in patch.splitlines() if line.startswith("+++ b/")})
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch)
        for relative in touched:
            if (tree / relative).exists():
                (copy / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(tree / relative, copy / relative)
        subprocess.run(["git", "apply", "--reject", "-"], cwd=copy, input=patch, text=True, capture_output=True)
        return {
            str(rej.relative_to(copy).with_suffix("")): sum(
                line.startswith("@@ ") for line in rej.read_text().splitlines()
            )
            for rej in sorted(copy.rglob("*.rej"))
        }


def patch_against(tree: Path, out: Path | None = None) -> tuple[Path, dict[str, int]]:
    """A patch for the upstream source tree ``tree`` (checked to apply there), and the hunks of the 0.6.2 patch
    that would need a rebase to apply to it."""
    patch = make_patch(tree)
    check_applies(patch, tree)
    out = out or ROOT / "dist" / f"megatron-bridge-ep-overlap-{tree.resolve().name}.patch"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(patch)
    with tempfile.TemporaryDirectory() as scratch:
        release = make_patch(unpack_sources(Path(scratch)))
    return out, hunks_needing_rebase(release, tree)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="upstream.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["plugin", "patch"])
    parser.add_argument("--against", type=Path, help="an upstream source tree (holding src/megatron/bridge)")
    args = parser.parse_args(argv)
    if args.what == "plugin":
        print(f"plugin wheel: {build_plugin()}")
    elif args.against is None:
        path = build_patch()
        print(f"series against megatron-bridge {VERSION} (git am applies it in order): {path.with_suffix('')}/")
        for patch in sorted(path.with_suffix("").glob("*.patch")):
            counts = added_lines(patch.read_text())
            source = sum(n for folder, n in counts.items() if not folder.startswith("tests"))
            print(f"  {patch.name}: {source} src/ lines added, {sum(counts.values()) - source} tests/")
        print(f"all of it in one file (git am, or git apply): {path}")
        counts = added_lines(path.read_text())
        for folder, lines in counts.items():
            print(f"  {lines:6d}  {folder}")
        source = sum(n for folder, n in counts.items() if not folder.startswith("tests"))
        print(f"  {source:6d}  added lines in src/ (and stored hunks); {sum(counts.values()) - source} in tests/")
    else:
        if not (args.against / PACKAGE).is_dir():
            print(f"error: --against {args.against}: no {PACKAGE} there; give a Megatron-Bridge source tree",
                  file=sys.stderr)  # fmt: skip
            return 2
        path, rebase = patch_against(args.against)
        print(f"series against {args.against} (applies cleanly), in one file: {path}")
        skipped = hunks_that_do_not_apply(args.against)
        for part in SERIES:
            for name in sorted(set(part.hunks) & set(skipped)):
                print(f"left out of that series: {part.subject!r} (tools/upstream_hunks/{name} does not apply there: "
                      "rebase it)")  # fmt: skip
        if not rebase:
            print(f"the {VERSION} patch applies to {args.against} as it is")
        for relative, hunks in rebase.items():
            print(f"the {VERSION} patch needs a rebase for {args.against}: {relative} ({hunks} hunk(s) do not apply)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
