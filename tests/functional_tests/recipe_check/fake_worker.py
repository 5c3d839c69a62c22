"""Test-only: a stand-in for the recipe check's worker, to test the check itself (what it takes, what it writes, how
it stops) in seconds, with no scratch venv and no Bridge.

    python fake_worker.py --check ARGS ...     tools/recipe_check.py ARGS, this script as its worker

``--check`` runs the check's own code (its process handling and ``stock_bridge.start`` included) with only the
stock-Bridge trees replaced: this project's interpreter, and this script as the worker. As the worker
(``fake_worker.py TREE OUT --universe`` or ``--recipes NAME ...``) it reads the JSON file named by
``RECIPE_CHECK_FAKE``: ``universe`` (the rows ``--universe`` answers), ``slow`` (names whose run never ends) and
``log`` (where it appends one JSON line per start, and one per run with its ranks' pids). Each run forks two sleeping
"ranks", as Megatron's ranks are forked into the worker's process group, and writes a ``bitwise`` row.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _log(config: dict, record: dict) -> None:
    with open(config["log"], "a") as log:
        log.write(json.dumps(record) + "\n")


def _rank() -> int:
    pid = os.fork()
    if pid == 0:
        time.sleep(600)
        os._exit(0)
    return pid


def worker(out: Path, mode: str, rest: list[str]) -> None:
    config = json.loads(Path(os.environ["RECIPE_CHECK_FAKE"]).read_text())
    names = [name for name in rest if not name.startswith("--")]
    _log(config, {"worker": mode, "names": names, "pid": os.getpid()})
    if mode == "--universe":
        out.write_text(json.dumps(config["universe"]))
        return
    for name in names:
        ranks = [_rank(), _rank()]
        _log(config, {"recipe": name, "ranks": ranks})
        time.sleep(600 if name in config["slow"] else 0.1)
        for pid in ranks:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        with out.open("a") as rows:
            rows.write(json.dumps({"recipe": name, "verdict": "bitwise", "why": "the fake worker's run"}) + "\n")


def check(argv: list[str]) -> int:
    sys.path[0] = str(ROOT / "tools")
    sys.path.insert(1, str(ROOT))
    import recipe_check

    from tests.functional_tests import stock_bridge

    tree = ROOT / "src"  # any folder with the lab in it: the worker's environment then needs no other
    stock_bridge.scratch_env = lambda: Path(sys.executable)
    stock_bridge.plugin_tree = lambda python: tree
    stock_bridge.patched_tree = lambda into: tree
    recipe_check.WORKER = Path(__file__)
    return recipe_check.main(argv)


if __name__ == "__main__":
    if sys.argv[1] == "--check":
        sys.exit(check(sys.argv[2:]))
    worker(Path(sys.argv[2]), sys.argv[3], sys.argv[4:])
