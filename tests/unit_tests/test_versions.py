"""Installed versions come from package metadata; local build tags are ignored."""

from importlib import metadata

from packaging.version import Version

from megatron.bridge.utils import versions


def test_torch_version_is_read_from_metadata():
    assert versions.torch_version() == Version(Version(metadata.version("torch")).public)


def test_missing_package_is_none():
    assert versions.installed_version("surely-not-an-installed-package-xyz") is None


def test_local_tag_is_dropped(monkeypatch):
    monkeypatch.setattr(metadata, "version", lambda name: "2.7.0+cu128")
    assert versions.installed_version("transformer-engine") == Version("2.7.0")
