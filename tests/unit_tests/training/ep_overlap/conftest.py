"""Fixtures for config tests: installed versions are faked, never read from this host. And the ``lab`` marker: a
test that compares against this project's lab (``ep_overlap_lab``: the reference engine and model) is skipped, with
the reason, where the lab is not installed, as in upstream's tree with the patch applied."""

import pytest
from packaging.version import Version

from megatron.bridge.utils import versions

from . import lab


@pytest.fixture
def fake_versions(monkeypatch):
    """Returns a setter: fake_versions(torch="2.6.0", te=None) makes the rules see those versions."""

    def set_versions(torch: str | None = "2.8.0", te: str | None = None) -> None:
        monkeypatch.setattr(versions, "torch_version", lambda: Version(torch) if torch else None)
        monkeypatch.setattr(versions, "te_version", lambda: Version(te) if te else None)

    set_versions()
    return set_versions


def pytest_configure(config):
    config.addinivalue_line("markers", "lab: compares against this project's lab (ep_overlap_lab); skipped without it")


def pytest_collection_modifyitems(config, items):
    if lab.installed():
        return
    skip = pytest.mark.skip(reason="compares against the project's lab (ep_overlap_lab), which is not installed here")
    for item in items:
        if "lab" in item.keywords:
            item.add_marker(skip)
