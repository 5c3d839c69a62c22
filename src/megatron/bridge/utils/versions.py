"""Installed package versions from package metadata (no CUDA import); tests may patch :func:`installed_version`."""

from importlib import metadata

from packaging.version import InvalidVersion, Version

# Distribution names under which Transformer Engine's PyTorch support is published.
_TE_DISTRIBUTIONS = ("transformer-engine", "transformer_engine", "transformer-engine-torch")


def installed_version(distribution: str) -> Version | None:
    """Returns the installed version of ``distribution``, or None when it is not installed."""
    try:
        raw = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None
    try:
        # Local build tags such as "2.7.0+cu128" or "2.14.1+cpu" compare by their public part.
        return Version(Version(raw).public)
    except InvalidVersion:
        return None


def torch_version() -> Version | None:
    """Installed PyTorch version."""
    return installed_version("torch")


def te_version() -> Version | None:
    """Installed Transformer Engine version, or None without Transformer Engine."""
    for name in _TE_DISTRIBUTIONS:
        version = installed_version(name)
        if version is not None:
            return version
    return None
