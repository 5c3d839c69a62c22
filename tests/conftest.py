"""Test-wide settings: GPU-marked tests skip cleanly on hosts without CUDA. ``EP_OVERLAP_HIDE_LAB=1`` makes the lab
(``ep_overlap_lab``) unimportable but for its launcher, in this process and the ranks it forks, to run the tests the
patch carries as upstream's tree runs them (``tools/upstream.py``, ``patch_tests``)."""

import importlib.abc
import os
import sys

import pytest
import torch


class _HiddenLab(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.startswith("ep_overlap_lab.") and name != "ep_overlap_lab.multiprocess":
            raise ModuleNotFoundError(f"No module named {name!r} (EP_OVERLAP_HIDE_LAB)", name=name)
        return None


if os.environ.get("EP_OVERLAP_HIDE_LAB") == "1":
    sys.meta_path.insert(0, _HiddenLab())


def pytest_collection_modifyitems(config, items):
    asked = config.getoption("markexpr") or ""
    for slow in ("memory", "wide"):  # the slow cases run when asked for by their marker
        if slow not in asked:
            skip_slow = pytest.mark.skip(reason=f"a slow case: runs with -m {slow}")
            for item in items:
                if slow in item.keywords:
                    item.add_marker(skip_slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this host has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
