"""Fixtures for config tests: installed versions are faked, never read from this host."""

import pytest
from packaging.version import Version

from megatron.bridge.utils import versions


@pytest.fixture
def fake_versions(monkeypatch):
    """Returns a setter: fake_versions(torch="2.6.0", te=None) makes the rules see those versions."""

    def set_versions(torch: str | None = "2.8.0", te: str | None = None) -> None:
        monkeypatch.setattr(versions, "torch_version", lambda: Version(torch) if torch else None)
        monkeypatch.setattr(versions, "te_version", lambda: Version(te) if te else None)

    set_versions()
    return set_versions
