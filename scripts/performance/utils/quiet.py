"""Silencing the third-party import noise the harness would otherwise print on every run (``-v`` keeps it).

Only these known messages are filtered, only in the harness's processes: each says an optional accelerator
package (Transformer Engine, Apex, absl) is absent or a default is deprecated, none of which applies to a
CPU/gloo run of the harness's models.
"""

import contextlib
import logging
import os
import warnings

KNOWN_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "absl.logging is not installed",
    "Only transformer-engine>=",
    "full scope is deprecated",
    "The following imports from `dynamic_context.py` will be removed",
)


@contextlib.contextmanager
def quiet_third_party_imports(enabled: bool = True):
    """Filters :data:`KNOWN_WARNINGS` and torch's CUDA_HOME and C++ (gloo hostname) warnings from here on.

    A context manager so the import it wraps reads as the reason; the filters stay for the rest of the process
    (ranks forked later inherit them), since the same warnings repeat when ranks build their models.
    """
    if enabled:
        for message in KNOWN_WARNINGS:
            warnings.filterwarnings("ignore", message=f".*{message}")
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime is found"
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # gloo's hostname-resolution fallback notices
    yield
