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
    if "memory" not in (config.getoption("markexpr") or ""):  # the slow memory matrix runs when asked for
        for item in items:
            if "memory" in item.keywords:
                item.add_marker(pytest.mark.skip(reason="the full memory comparison runs with -m memory"))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this host has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
