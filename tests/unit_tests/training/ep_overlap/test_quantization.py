"""Every module of a layer runs inside the low-precision context the plain path gives it, whichever way the step runs.

A spy stands in for Megatron-Core's ``get_fp8_context``/``get_fp4_context`` (``quantization_spy.py``) and records,
for every forward of every module that holds weights, the contexts open around it and whether it was the step's
first cast of its weights. The plain path (Megatron-Core's driver, overlap off) is the reference; Megatron-Core's own
schedule plan (``GPTModel`` only) must match it too, which is the test's check that it measures something. Before
the plan entered these contexts, the plan arms recorded no context at all (a bf16 GEMM where the recipe asked for
fp8).
"""

import pytest

from . import lab
from .local_ranks import run_local_ranks
from .mcore_arms import run_arm
from .mcore_cpu import init_megatron, install_cpu_stubs
from .mcore_models import HybridCase, McoreCase


def _low_precision(fields: dict):
    def prepare(model) -> None:
        for name, value in fields.items():
            setattr(model.config, name, value)

    return prepare


MXFP8 = {"fp8": "e4m3", "fp8_recipe": "mxfp8"}
BF16_ENDS = {"first_last_layers_bf16": True, "num_layers_at_start_in_bf16": 1, "num_layers_at_end_in_bf16": 1}

# name -> (case, config fields set after the model is built, the arms, PP 2 x VPP 2)
CASES = {
    # The example: MoE / dense / MoE, mxfp8, delayed wgrad in the plan arms.
    "gpt-mxfp8-delayed-wgrad": (
        McoreCase(layer_freq=(1, 0, 1), microbatches=3, steps=2, delay_wgrad=True),
        MXFP8,
        ("plain", "mcore", "hook", "engine"),
        False,
    ),
    # fp4: the first and the last layer kept in bf16 get no context, in every arm.
    "gpt-nvfp4-bf16-ends": (
        McoreCase(layer_freq=(1, 1, 1), microbatches=3),
        {"fp4": "e2m1", "fp4_recipe": "nvfp4", **BF16_ENDS},
        ("plain", "mcore", "hook", "engine"),
        False,
    ),
    # Delayed scaling: one context around the whole stack (Megatron-Core's driver opens it around each run, the
    # engine around each step of the program).
    "gpt-fp8-delayed": (
        McoreCase(layer_freq=(1, 0), microbatches=3),
        {"fp8": "hybrid", "fp8_recipe": "delayed"},
        ("plain", "mcore", "hook", "engine"),
        False,
    ),
    # Megatron-Core's own plan runs the MTP layer's final norm inside the fp8 context (no GEMM there), where its
    # plain forward does not: its arm is left out here.
    "gpt-mtp-tensorwise": (
        McoreCase(mtp=True, microbatches=3),
        {"fp8": "e4m3", "fp8_recipe": "tensorwise"},
        ("plain", "hook", "engine"),
        False,
    ),
    "hybrid-blockwise": (
        HybridCase(pattern="*E-E", microbatches=3),
        {"fp8": "e4m3", "fp8_recipe": "blockwise"},
        ("plain", "hook", "engine"),
        False,
    ),
    "hybrid-mtp-nvfp4": (
        HybridCase(pattern="*E*E/*E", microbatches=3),
        {"fp4": "e2m1", "fp4_recipe": "nvfp4"},
        ("plain", "hook", "engine"),
        False,
    ),
    # Full recompute: the replay runs under the context of the first forward.
    "gpt-mxfp8-full-recompute": (
        McoreCase(layer_freq=(1, 0, 1), microbatches=3, full_recompute=("uniform", 1)),
        MXFP8,
        ("plain", "hook", "engine"),
        False,
    ),
    "gpt-mxfp8-pp2-vpp2": (
        McoreCase(layer_freq=(1, 0, 1, 1), microbatches=4),
        MXFP8,
        ("plain", "hook", "engine"),
        True,
    ),
}


def _te_checkpoint_on_cpu() -> None:
    """Megatron-Core's checkpoint of a quantized block goes through Transformer Engine's ``te_checkpoint``: on CPU,
    its own checkpoint (the contexts are re-entered by the checkpointed function, which is what the spy sees)."""
    import megatron.core.recompute as recompute
    from megatron.core import tensor_parallel

    def te_checkpoint(function, distribute, rng_tracker, tp_group, *args, **kwargs):
        return tensor_parallel.checkpoint(lambda *inputs: function(*inputs, **kwargs), distribute, *args)

    recompute.te_checkpoint = te_checkpoint


def record_contexts(rank: int, world: int, name: str) -> dict:
    from . import quantization_spy

    case, fields, arms, pipeline = CASES[name]
    arms = lab.arms(*arms)
    install_cpu_stubs()
    if pipeline:
        init_megatron(case.world, 2, 2)
    else:
        init_megatron(world)
    quantization_spy.install()
    _te_checkpoint_on_cpu()
    out = {}
    for arm in arms:
        watch = quantization_spy.Watch()

        def prepare(model, watch=watch):
            _low_precision(fields)(model)
            watch.attach(model, prefix=f"vp{model.vp_stage}." if pipeline else "")

        run_arm(arm, case, prepare=prepare, pipeline=pipeline)
        out[arm] = {"forwards": dict(watch.forwards), "wgrads": dict(watch.wgrads)}
    return out


def _layers(forwards: dict) -> dict:
    return {n: c for n, c in forwards.items() if "decoder.layers" in n or "mtp.layers" in n}


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_layer_module_runs_in_the_plain_paths_low_precision_context(name):
    case, fields, arms, pipeline = CASES[name]
    arms = lab.arms(*arms)
    world = 4 if pipeline else case.world
    for outcome in run_local_ranks(record_contexts, world, (name,)):
        plain = outcome.result["plain"]["forwards"]
        layers = _layers(plain)
        assert layers, "no layer module ran"
        opened = {contexts for calls in layers.values() for contexts, _ in calls}
        assert any(contexts for contexts in opened), f"no low-precision context was opened: {opened}"
        for arm in arms[1:]:
            got = _layers(outcome.result[arm]["forwards"])
            assert got.keys() == layers.keys(), f"{arm}: {sorted(set(layers) ^ set(got))}"
            wrong = {
                module: (dict(layers[module]), dict(got[module])) for module in layers if got[module] != layers[module]
            }
            assert not wrong, f"rank {outcome.rank} {arm} differs from plain (module: plain, {arm}): {wrong}"


def test_a_bf16_end_layer_gets_no_context_and_the_others_theirs():
    """What the plain path itself does, so the comparison above compares something: layer 0 and layer 2 of three run
    with no context, layer 1 inside ``fp4:nvfp4@1``."""
    for outcome in run_local_ranks(record_contexts, 2, ("gpt-nvfp4-bf16-ends",)):
        for arm, recorded in outcome.result.items():
            for module, calls in _layers(recorded["forwards"]).items():
                contexts = {c for c, _ in calls}
                want = (("fp4:nvfp4@1",),) if "layers.1." in module else ((),)
                assert contexts == set(want), (arm, module, contexts)


def test_each_module_casts_its_weights_once_per_step_and_delayed_wgrad_runs_as_megatron_cores_plan():
    """Transformer Engine casts a module's weights on the step's first microbatch (``set_is_first_microbatch``): the
    engine must ask for it as Megatron-Core's driver does (2 steps: one first cast each). The delayed weight gradients
    run the same ``backward_dw`` calls as Megatron-Core's own plan, outside any per-layer context."""
    for outcome in run_local_ranks(record_contexts, 2, ("gpt-mxfp8-delayed-wgrad",)):
        result = outcome.result
        for arm in lab.arms("plain", "mcore", "hook", "engine"):
            for module, calls in _layers(result[arm]["forwards"]).items():
                firsts = sum(n for (_, first), n in calls.items() if first)
                assert firsts == 2, (arm, module, dict(calls))
        mcore = result["mcore"]["wgrads"]
        others = {arm: result[arm]["wgrads"] for arm in lab.arms("hook", "engine")}
        assert mcore and all(wgrads == mcore for wgrads in others.values()), {"mcore": mcore, **others}
        assert all(contexts == () for calls in mcore.values() for contexts, _ in calls)


def test_the_spy_sees_a_plan_that_drops_the_context():
    """Mutation check: with the plan's per-layer context switched off, the hook arm differs from the plain path."""
    for outcome in run_local_ranks(_without_layer_context, 2):
        assert outcome.result, "the hook arm matched the plain path with no context entered"


def _without_layer_context(rank: int, world: int) -> bool:
    import contextlib

    from megatron.bridge.training.ep_overlap.mcore import layer as layer_module

    layer_module.layer_context = lambda config, layer: contextlib.nullcontext()
    result = record_contexts(rank, world, "gpt-nvfp4-bf16-ends")
    return _layers(result["hook"]["forwards"]) != _layers(result["plain"]["forwards"])


def _has_te_gpu() -> bool:
    import importlib.util

    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def _fp8_on_gpu(rank: int, world: int, recipe: str) -> dict:
    import torch

    torch.cuda.set_device(0)
    torch.use_deterministic_algorithms(True)
    init_megatron(world)
    case = McoreCase(
        te=True, bf16=True, device="cuda", layer_freq=(1, 0, 1), microbatches=3, steps=2,
        config=(("fp8", "hybrid"), ("fp8_recipe", recipe)),
    )  # fmt: skip
    return {arm: run_arm(arm, case) for arm in ("plain", "hook")}


@pytest.mark.gpu
@pytest.mark.skipif(not _has_te_gpu(), reason="needs a CUDA device and Transformer Engine")
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])  # Hopper's; mxfp8 needs Blackwell
def test_fp8_overlap_is_bitwise_to_the_plain_path_on_gpu(recipe):
    """Transformer Engine's fp8 GEMMs (two gloo ranks on one GPU): the hook's plan against Megatron-Core's plain path,
    losses and gradients bitwise over 2 steps."""
    from .bitwise import assert_bitwise

    for outcome in run_local_ranks(_fp8_on_gpu, 2, (recipe,)):
        plain, hook = outcome.result["plain"], outcome.result["hook"]
        for step, (want, have) in enumerate(zip(plain["losses"], hook["losses"])):
            assert_bitwise(want.cpu(), have.cpu(), f"rank {outcome.rank} step {step} losses")
        for param, grad in plain["grads"].items():
            assert_bitwise(grad.cpu(), hook["grads"][param].cpu(), f"rank {outcome.rank} {param}")
