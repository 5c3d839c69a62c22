"""The wheel is the plugin: it installs beside a stock Megatron-Bridge and replaces none of its files.

Two modules of this tree are supersets of upstream files (``training/comm_overlap.py``,
``training/flex_dispatcher_backend.py``): the source tree and ``make patch`` carry them, the wheel does not, so an
installed Megatron-Bridge keeps its own. The editable install used by ``make test``/``make run`` maps the source
folders and sees them, which is the standalone mode (no upstream installed). Configuration is in pyproject.toml.
"""

from setuptools import setup
from setuptools.command.build_py import build_py

UPSTREAM_FILES = {
    ("megatron.bridge.training", "comm_overlap"),
    ("megatron.bridge.training", "flex_dispatcher_backend"),
}


class BuildPlugin(build_py):
    def find_package_modules(self, package, package_dir):
        return [m for m in super().find_package_modules(package, package_dir) if m[:2] not in UPSTREAM_FILES]


setup(cmdclass={"build_py": BuildPlugin})
