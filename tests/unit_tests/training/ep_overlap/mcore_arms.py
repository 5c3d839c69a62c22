"""Test-only: one Megatron-Core model's training step, run each way a user can run it, for tests that compare what
each way does to the model's modules (quantization contexts, graph replays, config reads).

    plain    Megatron-Core's driver, overlap off: the model's own forward and autograd backward
    mcore    Megatron-Core's driver with overlap on, running Megatron-Core's own schedule plan (``GPTModel`` only:
             0.19 has no plan for ``HybridModel``)
    hook     Megatron-Core's driver with overlap on, running this project's plan (``use_ep_overlap_schedule``)
    engine   this project's engine, overlapped (``EPOverlapEngine(chunk_for(model))``)

``train_plain_and_hook`` is the two-arm loop of the parallel-layout tests (TP, expert TP, CP), whose models and
forward steps are their own.

``run_arm`` builds a fresh model per arm, lets ``prepare(model)`` set config fields and install spies before any
driver sees the model, and runs ``case.steps`` steps; at PP 2 x VPP 2 (``pipeline=True``) the driver is Megatron-Core's
interleaved one and the model this rank's two chunks. Call it in a rank forked by ``run_local_ranks`` after
``install_cpu_stubs`` and ``init_megatron``.
"""

from contextlib import nullcontext
from datetime import timedelta

import torch

from .mcore_models import McoreCase, build_model
from .test_mcore_hook import MICRO_BATCH, SEQ, bridge_style_forward_step

ARMS = ("plain", "mcore", "hook", "engine")
TIMEOUT = timedelta(seconds=60)


def _chunks(case: McoreCase, pipeline: bool) -> list[torch.nn.Module]:
    if not pipeline:
        return [build_model(case)]
    from .mcore_stages import build_plans

    return [plan.model for plan in build_plans(case, 2, 2)]


def _data(case: McoreCase, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from megatron.core import parallel_state

    gen = torch.Generator().manual_seed(100 * step + parallel_state.get_data_parallel_rank())
    return [
        tuple(torch.randint(0, 64, (2, MICRO_BATCH, SEQ), generator=gen).to(case.device))
        for _ in range(case.microbatches)
    ]


def _driver_step(models, case: McoreCase, data) -> torch.Tensor | None:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    store = get_forward_backward_func()(
        forward_step_func=bridge_style_forward_step,
        data_iterator=[iter(list(data)) for _ in models] if len(models) > 1 else iter(data),
        model=models,
        num_microbatches=case.microbatches,
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        forward_only=False,
    )
    return torch.stack([logged["lm loss"] for logged in store]) if store else None


def run_arm(arm: str, case: McoreCase, *, prepare=None, pipeline: bool = False, around_step=nullcontext) -> dict:
    """``case.steps`` training steps of ``arm`` (see the module docstring), each inside ``around_step()``; returns the
    losses per step (None off the last stage; the engine's are normalized by the step's tokens), the gradients of
    the last step, and the chunks."""
    from megatron.bridge.training.ep_overlap.mcore import chunk_for, mcore_ep_groups, use_ep_overlap_schedule

    models = _chunks(case, pipeline)
    config = models[0].config  # shared by the chunks
    config.batch_p2p_comm = False  # gloo matches P2P in posting order (see test_mcore_hook)
    if prepare is not None:
        for model in models:
            prepare(model)
    engine = None
    if arm in ("mcore", "hook"):
        config.overlap_moe_expert_parallel_comm = True
        config.delay_wgrad_compute = case.delay_wgrad
    if arm == "hook":
        use_ep_overlap_schedule(models, timeout=TIMEOUT)
    if arm == "engine":  # the lab's engine: a test running this arm is marked lab
        from ep_overlap_lab.engine import EPOverlapEngine

        plans = [chunk_for(model, delay_wgrad=case.delay_wgrad) for model in models]
        engine = EPOverlapEngine(
            plans if pipeline else plans[0],
            mcore_ep_groups(TIMEOUT),
            overlap=True,
            delay_wgrad=case.delay_wgrad,
            attention_wgrad_window=1,
        )
    named = [(f"chunk{v}.{n}" if pipeline else n, p) for v, m in enumerate(models) for n, p in m.named_parameters()]
    optimizer = torch.optim.Adam([p for _, p in named], lr=1e-2)
    losses = []
    for step in range(case.steps):
        data = _data(case, step)
        with around_step():
            if engine is not None:
                result = engine.step(data).losses
                losses.append(torch.stack(result) if result else None)
            else:
                losses.append(_driver_step(models, case, data))
        grads = {n: p.grad.clone() for n, p in named if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"losses": losses, "grads": grads, "models": models}


def train_plain_and_hook(build, case: McoreCase, forward_step, *, seq_length: int = SEQ, extra=dict) -> dict:
    """Both arms of a parallel-layout test, ``case.steps`` Adam steps each through this project's
    ``get_forward_backward_func`` (Megatron-Core's for every layout but the plain 1F1B pipeline): ``build()`` makes a
    fresh model per arm; "plain" runs with the overlap off, "overlap" through the hook, its flags set after the build
    (Megatron-Core's config refuses them in fp32). Per arm: each step's losses (None off the last stage) and
    gradients, the phases the hook's lane ran, and ``extra()`` when the arm ends."""
    from megatron.core import parallel_state

    from megatron.bridge.training.ep_overlap.mcore import get_forward_backward_func, use_ep_overlap_schedule

    pipeline = parallel_state.get_pipeline_model_parallel_world_size()
    out = {}
    for arm in ("plain", "overlap"):
        model = build()
        model.config.batch_p2p_comm = False  # gloo pairs P2P in posting order
        if arm == "overlap":
            model.config.overlap_moe_expert_parallel_comm = True
            model.config.delay_wgrad_compute = case.delay_wgrad
            use_ep_overlap_schedule([model], timeout=timedelta(seconds=30))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses, grads, phases = [], [], set()
        for step in range(case.steps):
            store = get_forward_backward_func(pp_size=pipeline, vp_size=None)(
                forward_step_func=forward_step, data_iterator=iter(_data(case, step)), model=[model],
                num_microbatches=case.microbatches, seq_length=seq_length, micro_batch_size=MICRO_BATCH,
                forward_only=False,
            )  # fmt: skip
            losses.append(torch.stack([logged["lm loss"] for logged in store]) if store else None)
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            if arm == "overlap":
                phases |= {str(r.phase) for r in model.build_schedule_plan.recorder.comm}
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        out[arm] = {"losses": losses, "grads": grads, "phases": phases} | extra()
    return out
