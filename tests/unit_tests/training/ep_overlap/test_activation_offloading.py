"""Fine-grained activation offloading (``fine_grained_activation_offloading``, DeepSeek-V3's performance recipes)
under this project's plan, driven as Megatron-Core's own plan drives it.

Megatron-Core's offload manager starts a microbatch's offload groups when a model chunk's forward begins
(``preprocess_for_fine_grained_offloading``: the model's forward, or ``build_schedule_plan`` for its plan), and the
layers open and commit each group themselves (attention norm, its linears, core attention, its projection, pre-MLP
norm). On two CPU ranks (EP 2) with the offload stand-in (``offload_standin.py``: the manager moves CPU tensors,
counted), two steps (the manager records its groups in the first and offloads by that record in the second) of
DeepSeek-V3's shape (MLA, a dense first layer, shared experts, recomputed norms): losses and every gradient bitwise
equal to the plain path with offloading, and each microbatch's copies out and back in, group by group, the same as
under Megatron-Core's plan. Behind ``wide``: the same at PP 2 x VPP 2, with an MTP layer, and for a ``HybridModel``
(no Megatron-Core plan: its copies the plain path's). Without the plan making the chunk handlers nothing is
offloaded; the engine, which makes none, refuses it.
"""

from dataclasses import replace

import pytest

from .bitwise import assert_steps_bitwise
from .local_ranks import run_local_ranks
from .mcore_cpu import init_megatron, install_cpu_stubs
from .mcore_models import HybridCase, McoreCase

OFFLOADED = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm")
FIELDS = (
    ("fine_grained_activation_offloading", True),
    ("offload_modules", list(OFFLOADED)),
    ("min_offloaded_tensor_size", 64),  # these tiny activations: the manager skips smaller tensors
)
DEEPSEEK = McoreCase(
    mla=True, layer_freq=(0, 1, 1), shared_ffn=16, recompute=("layernorm",), microbatches=4, config=FIELDS
)
PIPELINED = McoreCase(mla=True, layer_freq=(0, 1, 1, 1, 1, 1, 1, 1), shared_ffn=16, microbatches=4, config=FIELDS)


class _EachStep:
    """Around each of ``run_arm``'s steps: the copies it made, and the gradients once its backward ran."""

    def __init__(self, counts):
        self.counts, self.models, self.copies, self.grads = counts, [], [], []

    def __call__(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.copies.append(self.counts.take())
        named = [(f"chunk{v}.{n}", p) for v, m in enumerate(self.models) for n, p in m.named_parameters()]
        self.grads.append({n: p.grad.clone() for n, p in named if p.grad is not None})


def _train(rank: int, world: int, case: McoreCase, pipeline: bool, arms: tuple) -> dict:
    install_cpu_stubs()
    init_megatron(case.world, *((2, 2) if pipeline else ()))
    from .mcore_arms import run_arm
    from .offload_standin import fresh_offload_manager, install_offload_standin

    counts = install_offload_standin()
    out = {}
    for arm in arms:
        fresh_offload_manager()
        each = _EachStep(counts)
        result = run_arm(arm, case, prepare=each.models.append, pipeline=pipeline, around_step=each)
        out[arm] = {"losses": result["losses"], "grads": each.grads, "copies": each.copies}
    return out


def _check(case: McoreCase, pipeline: bool, arms=("plain", "mcore", "hook"), bitwise=("mcore", "hook")) -> None:
    """``bitwise``: the arms bitwise equal to the plain path; the copies: the hook's as ``arms[-2]``'s."""
    for outcome in run_local_ranks(_train, 4 if pipeline else 2, (case, pipeline, arms)):
        got, rank = outcome.result, outcome.rank
        for arm in bitwise:
            assert_steps_bitwise(got["plain"], got[arm], case.steps, rank)
        reference, hook = got[arms[-2]]["copies"], got["hook"]["copies"]
        for step, copies in enumerate(hook):
            # every microbatch's tensors moved out and back in, in each step (the first records, the second replays)
            offloaded = {handler for handler, _ in copies["offloads"]}
            assert len(offloaded) == case.microbatches * (2 if pipeline else 1), (rank, step, copies)
            assert sum(copies["offloads"].values()) == sum(copies["reloads"].values()) > 0, (rank, step, copies)
            assert copies == reference[step], (rank, step, copies, reference[step])


def test_offloading_under_the_plan_is_driven_as_megatron_cores_plan_drives_it():
    _check(DEEPSEEK, pipeline=False)


# Megatron-Core's own plan is not bitwise equal to the plain path at PP 2 x VPP 2 with offloading on (it is with
# offloading off; there the plain path's numbers move with the flag even when nothing is offloaded), nor with an MTP
# layer (with offloading or without): there it gives the copies only. It has no plan for a HybridModel: there the plain
# path gives them.
WIDE = {
    "pp2-vpp2": (PIPELINED, True, ("plain", "mcore", "hook"), ("hook",)),
    "mtp": (replace(DEEPSEEK, mtp=True), False, ("plain", "mcore", "hook"), ("hook",)),
    "hybrid": (HybridCase(pattern="*E*E", microbatches=4, config=FIELDS), False, ("plain", "hook"), ("hook",)),
}


@pytest.mark.wide
@pytest.mark.parametrize("name", sorted(WIDE))
def test_offloading_under_the_plan_wide(name):
    _check(*WIDE[name])


@pytest.mark.lab
def test_the_engine_refuses_offloading_naming_the_driver_that_runs_it():
    from types import SimpleNamespace

    import torch

    from ep_overlap_lab.engine.step_hooks import step_problems

    config = SimpleNamespace(
        fine_grained_activation_offloading=True,
        experimental_attention_variant=None,
        experimental_attention_variant_loss_scale_func=None,
    )
    (problem,) = step_problems(torch.nn.Linear(1, 1), config)
    assert problem.startswith("fine_grained_activation_offloading:") and "use_ep_overlap_schedule" in problem
    assert "fix: " in problem
    config.fine_grained_activation_offloading = False
    assert step_problems(torch.nn.Linear(1, 1), config) == []
