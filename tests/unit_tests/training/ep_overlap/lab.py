"""Whether this project's lab (``ep_overlap_lab``: the reference engine and model) is installed. Where it is not
(upstream's tree with the patch applied), a test that runs the lab's engine beside the plan's arms runs the plan's
arms alone, and a test that needs the lab whole is marked ``lab`` and skipped (``conftest.py``)."""

import importlib.util


def installed() -> bool:
    try:
        return importlib.util.find_spec("ep_overlap_lab.engine") is not None
    except ModuleNotFoundError:
        return False


def arms(*names: str) -> tuple[str, ...]:
    """``names`` without the lab engine's arms (``engine...``) where the lab is not installed."""
    return names if installed() else tuple(name for name in names if not name.startswith("engine"))
