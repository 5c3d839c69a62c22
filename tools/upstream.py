"""Megatron-Bridge 0.6.2 from the package registry, and the two ways this project ships against it.

    python tools/upstream.py plugin    # dist/megatron_bridge_ep_overlap-*.whl: installs beside upstream
    python tools/upstream.py patch     # dist/megatron-bridge-ep-overlap.patch: for a fork of upstream

The patch holds this project's new modules and its changes to upstream's ``training/comm_overlap.py`` and
``training/flex_dispatcher_backend.py``, against the 0.6.2 sources (the registry's sdist, fetched here into
build/, never committed). It is checked with ``git apply --check`` on a fresh unpack before it is written.
"""

import difflib
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.6.2"
CACHE = ROOT / "build" / f"megatron-bridge-{VERSION}"
PATCH = ROOT / "dist" / "megatron-bridge-ep-overlap.patch"
PACKAGE = Path("src/megatron/bridge")


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


def _diff(relative: Path, upstream_root: Path) -> str:
    ours = (ROOT / relative).read_text().splitlines(keepends=True)
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


def build_patch(path: Path = PATCH) -> Path:
    """Writes the patch against the 0.6.2 sources, after checking that it applies to a fresh unpack."""
    with tempfile.TemporaryDirectory() as scratch:
        upstream_root = unpack_sources(Path(scratch))
        files = sorted(p.relative_to(ROOT) for p in (ROOT / PACKAGE).rglob("*.py"))
        patch = "".join(_diff(relative, upstream_root) for relative in files)
        check_applies(patch)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(patch)
    return path


def check_applies(patch: str) -> None:
    """Raises CalledProcessError unless ``patch`` applies cleanly to a fresh unpack of the 0.6.2 sources."""
    with tempfile.TemporaryDirectory() as scratch:
        root = unpack_sources(Path(scratch))
        subprocess.run(["git", "apply", "--check", "-"], cwd=root, input=patch, text=True, check=True,
                       capture_output=True)  # fmt: skip


def main(argv: list[str]) -> int:
    if argv == ["plugin"]:
        print(f"plugin wheel: {build_plugin()}")
    elif argv == ["patch"]:
        print(f"patch against megatron-bridge {VERSION} (applies cleanly): {build_patch()}")
    else:
        print("usage: python tools/upstream.py plugin|patch", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
