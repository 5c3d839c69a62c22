"""Test-only: Megatron-Core 0.19.2's own combined-1F1B plan's verdict on a recipe, beside this project's (the recipe
check's third verdict; never product).

Decided by Megatron-Core's and Bridge's own code, run on deep copies of the recipe's built ``ConfigContainer``, never
by a copy of their rules:

1. **The recipe with the overlap off** (``overlap_moe_expert_parallel_comm`` and ``delay_wgrad_compute`` off on the
   model and in ``comm_overlap``): Bridge's ``runtime_config_update`` steps that check the model (its mixed precision
   applied, ``CommOverlapConfig.finalize``/``setup``), then the provider's ``finalize()``, which runs Megatron-Core's
   ``TransformerConfig.__post_init__``, and for an experimental attention variant the layer spec Megatron-Core builds
   for it (a variant 0.19.2 does not have fails the model build). What raises here fails the recipe on any plan:
   ``overlap_off`` says it.
2. **The overlap on, as Bridge's performance scripts' ``--moe_a2a_overlap true`` turns it on** (the flag and delayed
   wgrad in ``comm_overlap``, ``moe_shared_expert_overlap`` off): the same steps, so Bridge's ``comm_overlap`` checks
   and Megatron-Core's ``__post_init__`` asserts for the overlap run; the first that raises is the verdict's ``why``.
3. **The model has ``build_schedule_plan``**: Megatron-Core's combined 1F1B asks the model for it; the model class is
   the one the provider's ``provide`` returns (its annotation, else the module class its code names), and of the
   recipes' models only Megatron-Core's ``GPTModel`` has it.

On a host without Transformer Engine, version and kernel-availability checks inside those steps would refuse rows a
GPU host runs (471 of the 494 rows, each as ``recipe fails``). Only while the verdict runs, :func:`as_on_a_gpu_host`
answers those that fire on the recipes (:data:`STAND_INS`) as a GPU host with Transformer Engine 2.14 does:
``is_te_min_version`` in Megatron-Core's ``transformer_config`` (fp8 MoE, fp8 ``moe_act``/``layernorm`` recompute)
and in Bridge's ``mixed_precision`` (fp4) and ``comm_overlap`` (delayed wgrad with ``overlap_grad_reduce`` or
``gradient_accumulation_fusion``); the fused permutation kernels (``moe_permute_fusion``) and fused RoPE
(``apply_rope_fusion``) that ``__post_init__`` looks up; DSA's CUDA-device check for its kernel backend.
"""

import contextlib
import copy
import traceback
import typing

TE_VERSION = "2.14.0"  # what the GPU host answers for a version check (Megatron-Core 0.19's newest TE gate)


def _te_versions() -> list[tuple[object, str, object]]:
    """``is_te_min_version``/``get_te_version`` where Megatron-Core's ``__post_init__``, Bridge's ``comm_overlap``
    checks and Bridge's mixed-precision ``finalize()`` read them (fp8 MoE, fp4, delayed wgrad, grouped GEMM)."""
    from megatron.core.transformer import transformer_config
    from packaging.version import Version

    from megatron.bridge.training import comm_overlap, mixed_precision

    def at_least(version, check_equality=True):
        return Version(TE_VERSION) >= Version(version) if check_equality else Version(TE_VERSION) > Version(version)

    modules = (transformer_config, comm_overlap, mixed_precision)
    return [(module, "is_te_min_version", at_least) for module in modules] + [
        (module, "get_te_version", lambda: Version(TE_VERSION))
        for module in modules
        if hasattr(module, "get_te_version")
    ]


def _fused_kernels() -> list[tuple[object, str, object]]:
    """The kernels whose absence ``__post_init__`` refuses: fused permutation (``moe_permute_fusion``) and fused
    RoPE (``apply_rope_fusion``); only looked up, never called here."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.moe import moe_utils

    names = {moe_utils: ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                         "fused_sort_chunks_by_index_with_probs", "fused_unpermute"),
             rope_utils: ("fused_apply_rotary_pos_emb", "fused_apply_rotary_pos_emb_thd")}  # fmt: skip
    return [(module, name, getattr(module, name) or _kernel(name)) for module, each in names.items() for name in each]


def _dsa_kernels() -> list[tuple[object, str, object]]:
    """DSA's kernel backend: its name still checked, the CUDA device and the fused-kernel packages taken as there."""
    from megatron.core import utils
    from megatron.core.transformer import transformer_config

    def names_only(backend: str) -> None:
        if backend not in utils._VALID_DSA_KERNEL_BACKENDS:
            utils._validate_dsa_kernel_backend_dependencies(backend)  # its own error, word for word

    return [(transformer_config, "_validate_dsa_kernel_backend_dependencies", names_only)]


# What a host without Transformer Engine, a CUDA device or the fused kernels answers otherwise than a GPU host.
STAND_INS = {"TE version": _te_versions, "fused kernels": _fused_kernels, "DSA kernel backend": _dsa_kernels}


@contextlib.contextmanager
def as_on_a_gpu_host(skip: tuple[str, ...] = ()):
    """The checks in :data:`STAND_INS` (less ``skip``) answered as on a GPU host, in this block only."""
    patches = [patch for name, make in STAND_INS.items() if name not in skip for patch in make()]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    try:
        for module, name, value in patches:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


def _kernel(name: str):
    def absent(*args, **kwargs):
        raise RuntimeError(f"{name}: a Transformer Engine kernel, only looked up here")

    return absent


def _one_line(error: BaseException) -> str:
    """The error's message, one line; an assert without one: its condition as the source says it."""
    text = " ".join(str(error).split())
    if not text:
        frame = traceback.extract_tb(error.__traceback__)[-1]
        text = f"assert {frame.line.removeprefix('assert').strip() if frame.line else '(no message)'}"
    return f"{type(error).__name__}: {text}"[:300]


def _checked(cfg, overlap: bool) -> str | None:
    """Bridge's and Megatron-Core's checks on a copy of ``cfg`` with the overlap on or off: None, or what raised."""
    from megatron.bridge.training.mixed_precision import get_mixed_precision_config

    from megatron.bridge.training.comm_overlap import CommOverlapConfig

    cfg = copy.deepcopy(cfg)  # outside the try: a copy that fails is the check's, not the recipe's
    model = cfg.model
    model.overlap_moe_expert_parallel_comm = model.delay_wgrad_compute = False  # comm_overlap.setup decides them
    if overlap:
        model.moe_shared_expert_overlap = False
    if cfg.comm_overlap is None:
        cfg.comm_overlap = CommOverlapConfig(tp_comm_overlap=False)
    cfg.comm_overlap.overlap_moe_expert_parallel_comm = cfg.comm_overlap.delay_wgrad_compute = overlap
    try:
        with as_on_a_gpu_host():
            mixed = cfg.mixed_precision
            if mixed is not None:
                mixed = get_mixed_precision_config(mixed) if isinstance(mixed, str) else mixed
                mixed.finalize()
                mixed.setup(model, cfg.optimizer, cfg.ddp)
            cfg.comm_overlap.finalize()
            cfg.comm_overlap.data_parallel_size = 1  # the cluster's; it sets defaults, decides no check
            cfg.comm_overlap.setup(model, cfg.optimizer, cfg.ddp)
            model.finalize()
            if getattr(model, "experimental_attention_variant", None):
                _variant_spec(model)
    except Exception as error:
        return _one_line(error)
    return None


def _variant_spec(config) -> None:
    """The layer spec Megatron-Core builds for an experimental attention variant, the model build's first step: a
    variant it does not have (DeepSeek-V4's) fails there, whatever the config's checks passed."""
    import torch
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_experimental_attention_variant_module_spec,
    )

    class Backend(LocalSpecProvider):  # as Transformer Engine's, which has the plain linear DSA names
        def linear(self):
            return torch.nn.Linear  # a spec names classes; nothing is built

    get_experimental_attention_variant_module_spec(config=config, backend=Backend())


def model_class(provider) -> type | None:
    """The model class ``provider.provide`` returns: its annotation; without one, the ``torch.nn.Module`` class its
    code names (a module global or a local import); None where neither says."""
    import importlib

    import torch

    provide = type(provider).provide
    try:
        hinted = typing.get_type_hints(provide).get("return")
    except Exception:  # a name imported for type checking only
        hinted = None
    if isinstance(hinted, type):
        return hinted
    names = provide.__code__.co_names
    scopes = [provide.__globals__]
    for name in names:  # ``from package.module import Model`` inside provide: the module is among the names
        if "." in name:
            with contextlib.suppress(Exception):
                scopes.append(vars(importlib.import_module(name)))
    for name in names:
        for scope in scopes:
            value = scope.get(name)
            if isinstance(value, type) and issubclass(value, torch.nn.Module):
                return value
    return None


def mcore_verdict(cfg) -> dict:
    """Megatron-Core's plan on ``cfg`` (see the module docstring): ``verdict`` (``runs``, ``refused``, ``recipe
    fails``, or ``not judged`` where the check itself could not), ``why`` (one line), and ``overlap_off`` (None, or
    what fails the recipe with the overlap off)."""
    try:
        off = _checked(cfg, overlap=False)
        on = None if off is not None else _checked(cfg, overlap=True)
        built = model_class(cfg.model)
    except Exception as error:  # copying the config or finding its model class: the check's limit
        return {
            "verdict": "not judged",
            "why": f"the check could not judge it: {_one_line(error)}",
            "overlap_off": None,
        }
    if off is not None:
        return {"verdict": "recipe fails", "why": f"with the overlap off: {off}", "overlap_off": off}
    if on is not None:
        return {"verdict": "refused", "why": on, "overlap_off": None}
    if built is None or not callable(getattr(built, "build_schedule_plan", None)):
        name = built.__name__ if built is not None else f"{type(cfg.model).__name__}.provide's model (not named)"
        return {"verdict": "refused", "why": f"{name} has no build_schedule_plan", "overlap_off": None}
    return {"verdict": "runs", "why": "", "overlap_off": None}


def main() -> None:
    """``python mcore_plan.py TREE OUT.json QNAME ...``: each recipe's verdict, ``{QNAME: verdict}`` in OUT.json (run
    in the stock-Bridge scratch interpreter, as the worker is)."""
    import json
    import sys
    from pathlib import Path

    from tests.functional_tests.recipe_check.offline import install
    from tests.functional_tests.recipe_check.universe import config_functions

    tree, out, names = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    install(tree)
    functions = config_functions()
    out.write_text(json.dumps({name: mcore_verdict(functions[name]()) for name in names}))


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(1, str(Path(__file__).resolve().parents[3]))  # the tests' stand-ins; never src/
    main()
