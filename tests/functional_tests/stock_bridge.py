"""Test-only: a scratch interpreter with stock Megatron-Bridge 0.6.2's training loop importable, in both install modes.

:func:`scratch_env` builds (once, cached under ``build/stock-bridge/``) a venv that has upstream's 0.6.2 wheel and what
its loop imports on a CPU host (``tools/stock_bridge_requirements.txt``), torch and Megatron-Core coming from this
project's venv (a path entry, its own .pth files unread). :func:`plugin_tree` installs this project's plugin wheel
there and returns that site-packages; :func:`patched_tree` unpacks the 0.6.2 sources with our patch applied and
returns their ``src/``. :func:`run` runs a script with one of these trees as the ``megatron.bridge`` it imports.

Two import stand-ins, written as the scratch ``sitecustomize``: upstream's package ``__init__`` (it imports every
model bridge; ``megatron.bridge`` becomes a bare package over the tree, every subpackage runs its own ``__init__``),
and the import-only Transformer Engine stand-in of ``tools/upstream_ci.py``. Raises ``RegistryUnreachable`` when
the package registry cannot be reached.
"""

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import upstream  # noqa: E402
import upstream_ci  # noqa: E402

REQUIREMENTS = ROOT / "tools" / "stock_bridge_requirements.txt"
CACHE = ROOT / "build" / "stock-bridge"
VENV_SITE = next((ROOT / ".venv" / "lib").glob("python3.*/site-packages"))

BARE_PACKAGE = '''
import importlib.abc, importlib.machinery, os, sys
from pathlib import Path


class _BareBridge(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """megatron.bridge as a bare package over EP_OVERLAP_BRIDGE_TREE: its __init__ (every model bridge) is skipped."""

    def find_spec(self, name, path, target=None):
        if name != "megatron.bridge":
            return None
        spec = importlib.machinery.ModuleSpec(name, self, is_package=True)
        spec.submodule_search_locations = [str(Path(os.environ["EP_OVERLAP_BRIDGE_TREE"]) / "megatron" / "bridge")]
        return spec

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        pass


if os.environ.get("EP_OVERLAP_BRIDGE_TREE"):
    sys.meta_path.insert(0, _BareBridge())
'''


class RegistryUnreachable(RuntimeError):
    pass


# What pip says when it cannot reach an index (any other failure is an error of the test environment, not a skip).
_UNREACHABLE = ("Could not fetch URL", "Failed to establish a new connection", "Temporary failure in name resolution",
                "Network is unreachable", "No matching distribution found", "Read timed out")  # fmt: skip


def _pip(python: Path, *args: str) -> None:
    try:
        subprocess.run([sys.executable, "-m", "pip", "-q", "--python", str(python), *args], check=True,
                       capture_output=True, text=True)  # fmt: skip
    except subprocess.CalledProcessError as exc:
        if any(sign in exc.stderr for sign in _UNREACHABLE):
            raise RegistryUnreachable(exc.stderr.strip().splitlines()[-1:]) from exc
        raise RuntimeError(f"pip {' '.join(args)} failed: {exc.stderr.strip()[-2000:]}") from exc


def scratch_env_or_skip() -> Path:
    """:func:`scratch_env`, or the calling test skipped with the reason when the package registry cannot be reached."""
    import pytest

    try:
        return scratch_env()
    except RegistryUnreachable as exc:
        pytest.skip(f"the package registry cannot be reached: {exc}")


def scratch_env() -> Path:
    """The scratch venv's interpreter (built on first use; rebuilt when the requirements change)."""
    try:
        wheel = upstream.upstream_wheel()
    except subprocess.CalledProcessError as exc:
        raise RegistryUnreachable(exc.stderr.strip().splitlines()[-1:]) from exc
    stamp = hashlib.sha256(REQUIREMENTS.read_bytes() + wheel.name.encode() + str(VENV_SITE).encode()).hexdigest()
    env = CACHE / "venv"
    python = env / "bin" / "python"
    if (env / "stamp").exists() and (env / "stamp").read_text() == stamp:
        return python
    subprocess.run(["rm", "-rf", str(env)], check=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    site = site_packages(python)
    (site / "base.pth").write_text(f"{VENV_SITE}\n")
    (site / "sitecustomize.py").write_text(upstream_ci.TE_STAND_IN + BARE_PACKAGE)
    _pip(python, "install", "--no-deps", str(wheel))
    _pip(python, "install", "-r", str(REQUIREMENTS))
    (env / "stamp").write_text(stamp)
    return python


def site_packages(python: Path) -> Path:
    return Path(subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())  # fmt: skip


def plugin_tree(python: Path) -> Path:
    """Stock 0.6.2 plus this project's plugin wheel (rebuilt from the working tree): their site-packages."""
    wheel = upstream.build_plugin(CACHE / "plugin")
    _pip(python, "install", "--no-deps", "--force-reinstall", str(wheel))
    return site_packages(python)


def patched_tree(into: Path) -> Path:
    """The 0.6.2 sources with this project's patch applied: their ``src/``."""
    patch = upstream.build_patch(into / "ep-overlap.patch").read_text()
    root = upstream.unpack_sources(into / "tree")
    subprocess.run(["git", "apply", "-"], cwd=root, input=patch, text=True, check=True, capture_output=True)
    return root / "src"


def _lab_alone() -> Path:
    """A folder holding only this project's lab (``ep_overlap_lab``, a link): the rank launcher the loop scripts use.
    The patched tree has no lab (upstream gets none), and ``src/`` would also hold our ``megatron.bridge``."""
    folder = CACHE / "lab-alone"
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "ep_overlap_lab"
    if not link.exists():
        link.symlink_to(ROOT / "src" / "ep_overlap_lab", target_is_directory=True)
    return folder


def _env(tree: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    if not (tree / "ep_overlap_lab").is_dir():  # the patched tree: the lab comes from this project
        env["PYTHONPATH"] = str(_lab_alone())
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # no hub here: fail at once, never retry
    return env | offline | {"EP_OVERLAP_BRIDGE_TREE": str(tree), "PYTHONDONTWRITEBYTECODE": "1",
                            "HOME": tempfile.gettempdir()}  # fmt: skip


def run(python: Path, tree: Path, script: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``script`` in the scratch interpreter, importing ``megatron.bridge`` from ``tree``."""
    return subprocess.run([python, str(script), str(tree), *args], capture_output=True, text=True, timeout=timeout,
                          env=_env(tree), cwd=tempfile.gettempdir())  # fmt: skip


def start(python: Path, tree: Path, script: Path, *args: str, log: Path) -> subprocess.Popen:
    """``script`` as :func:`run` runs it, in the background, its output in ``log``; it leads a process group of its
    own, which the processes it forks join: the caller stops them all at once (``os.killpg``)."""
    with log.open("w") as out:
        return subprocess.Popen([python, str(script), str(tree), *args], stdout=out, stderr=subprocess.STDOUT,
                                text=True, env=_env(tree), cwd=tempfile.gettempdir(),
                                start_new_session=True)  # fmt: skip
