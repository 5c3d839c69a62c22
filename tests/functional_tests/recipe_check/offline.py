"""Test-only: what lets Megatron-Bridge 0.6.2's recipe functions build on a host without the Hugging Face hub, a GPU
or ``diffusers`` (the recipe check's stand-ins; never product).

* **Model configs.** A recipe loads its model's ``config.json`` from the hub (``AutoBridge.from_hf_pretrained``).
  Here :class:`OfflineConfigs` gives, for a model id, the published ``config.json`` fields the check carries as data
  (``tests/functional_tests/hf_configs/<org>--<model>.json``: ``_source`` names where they come from, ``_complete``
  whether they are the whole published file): as ``transformers``' own config class of that model type where the
  scratch ``transformers`` knows the type, else as the class the checkpoint's remote code names where
  ``transformers`` has it, else as a plain config with those fields. The row names which. An id the check carries
  nothing for is the check's limit, not the recipe's (:class:`CheckLimit`), as is a recipe that fails on fields a
  partial file lacks; no retry waits for a hub that is not there.
* **GPU properties.** A recipe that asks which flex dispatcher backend the GPU takes sees an H100.
* **diffusers.** Only the flux recipes import it, to build what no check builds: empty modules.
"""

import importlib.abc
import importlib.machinery
import json
import sys
import types
from pathlib import Path

HF_CONFIGS = Path(__file__).resolve().parents[1] / "hf_configs"
# Bridge's config loader retries a failed load with sleeps unless the error says the file is missing, which it is.
_NO_RETRY = "does not appear to have a file named config.json"
LIMIT = "the check could not"  # how a row that failed inside the check starts


class CheckLimit(OSError):
    """A recipe the check cannot build for a reason of its own (no stored config for the model, say)."""


def _file_of(model_id: str) -> Path:
    return HF_CONFIGS / (model_id.strip("/").replace("/", "--") + ".json")


class OfflineConfigs:
    """``AutoConfig.from_pretrained`` for a host without the hub: the stored published fields of each model id."""

    def __init__(self):
        self.used: list[str] = []  # "<id>: <what> as <class>", in the order the recipe asked
        self.partial: list[str] = []  # the ids whose stored fields are not the whole published file

    def clear(self) -> None:
        self.used.clear()
        self.partial.clear()

    def load(self, model_id, **_kwargs):
        path = _file_of(str(model_id))
        if not path.exists():
            raise CheckLimit(
                f"{LIMIT} load {model_id}'s config offline: it carries no published config.json for it "
                f"({path.relative_to(HF_CONFIGS.parents[2])} is missing); {_NO_RETRY} here"
            )
        fields = json.loads(path.read_text())
        complete = fields.pop("_complete")
        fields = {k: v for k, v in fields.items() if not k.startswith("_")}
        config, how = _config_of(fields)
        self.used.append(f"{model_id}: {'published config.json' if complete else 'partial fields'} as {how}")
        if not complete:
            self.partial.append(str(model_id))
        return config


def _config_of(fields: dict):
    """A config object of ``fields``: ``transformers``' class for the model type; else the class the checkpoint's
    remote code names (``auto_map``), where ``transformers`` has one; else a plain config with the fields set, its
    sub-configs (``*_config``) plain configs too."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    fields = dict(fields)
    model_type = fields.pop("model_type")
    if model_type in CONFIG_MAPPING_NAMES:
        config = transformers.AutoConfig.for_model(model_type, **fields)
        return config, type(config).__name__
    remote = (fields.get("auto_map") or {}).get("AutoConfig", "").rsplit(".", 1)[-1]
    named = getattr(transformers, remote, None) if remote else None
    if isinstance(named, type) and issubclass(named, transformers.PretrainedConfig):
        config = named(**fields)
        config.model_type = model_type
        return config, f"{remote} (its remote code's class)"
    return _plain_config(model_type, fields), "PretrainedConfig"


def _plain_config(model_type: str, fields: dict):
    import transformers

    config = transformers.PretrainedConfig()
    config.model_type = model_type
    for name, value in fields.items():
        if name.endswith("_config") and isinstance(value, dict) and "model_type" in value:
            value = _config_of(value)[0]
        elif name.endswith("_config") and isinstance(value, dict):
            value = _plain_config(name, value)
        setattr(config, name, value)
    return config


class _Unavailable(type):
    """A ``diffusers`` class: importable, and the check's limit as soon as a recipe uses it."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise CheckLimit(f"{LIMIT} build it: diffusers ({cls.__name__}.{name}) is an empty stand-in here")


class _AnyModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unavailable(name, (), {})


class _EmptyDiffusers(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``diffusers`` and its submodules as empty modules."""

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] != "diffusers":
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        return _AnyModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def install(tree: Path) -> OfflineConfigs:
    """The real ``megatron.bridge`` package of ``tree`` (recipes import ``AutoBridge`` from its ``__init__``), empty
    ``diffusers``, offline configs, an H100's properties. Returns the configs' record."""
    import torch
    import transformers

    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "_BareBridge"]
    sys.path.insert(0, str(tree))
    torch.cuda.get_device_properties = lambda *args: types.SimpleNamespace(
        major=9, minor=0, name="NVIDIA H100 80GB HBM3"
    )
    sys.meta_path.insert(0, _EmptyDiffusers())
    configs = OfflineConfigs()
    transformers.AutoConfig.from_pretrained = classmethod(lambda cls, model_id, *a, **k: configs.load(model_id, **k))
    return configs


def limit_of(error: BaseException) -> str | None:
    """The check's own limit behind ``error`` (a recipe wraps the loader's error in its own), or None."""
    while error is not None:
        if isinstance(error, CheckLimit):
            return str(error).split("; " + _NO_RETRY)[0]
        error = error.__cause__ or error.__context__
    return None
