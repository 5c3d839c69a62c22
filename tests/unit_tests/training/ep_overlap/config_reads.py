"""Test-only: records which ``TransformerConfig`` fields are read while it records (one training step).

:func:`attach` gives every config a model's modules hold (the model's, and any copy a module made for itself) a class
of its own that notes each field read; :meth:`ConfigReads.recording` is the span that counts.
"""

import contextlib
import dataclasses


class ConfigReads:
    def __init__(self):
        self.fields: set[str] = set()
        self._on = False

    @contextlib.contextmanager
    def recording(self):
        self._on = True
        try:
            yield
        finally:
            self._on = False

    def attach(self, model) -> None:
        for module in model.modules():
            config = getattr(module, "config", None)
            if dataclasses.is_dataclass(config) and not getattr(type(config), "_records_reads", False):
                config.__class__ = self._recording_class(type(config))

    def _recording_class(self, cls):
        names = {field.name for field in dataclasses.fields(cls)}
        reads = self

        def __getattribute__(config, name):
            if reads._on and name in names:
                reads.fields.add(name)
            return cls.__getattribute__(config, name)

        return type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "_records_reads": True})
