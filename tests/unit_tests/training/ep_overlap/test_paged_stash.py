"""Paged stash (``moe_paged_stash``, what Megatron-Bridge 0.6.2's performance recipes set) under this project's plan.

Megatron-Core's paged stash pages the routed experts' activations out after each expert group's forward and back in
before its backward, in an order it records in its first step and asserts after. Under Megatron-Core's driver with the
pre-wrap hook, the plan calls the model's ``preprocess_for_paged_stash`` per built plan, where Megatron-Core's own
plan does; the driver starts each step (``paged_stash_reset``). On two (four) CPU ranks, with the static HybridEP
stand-in (paged stash needs ``moe_expert_rank_capacity_factor``), the stand-ins of the two Triton kernels
(``paged_stash_kernels.py``) and experts that stash as Transformer Engine's fused grouped MLP does
(``paged_stash_experts.py``):

* the kernel stand-ins keep the kernels' free lists (checked against a plain Python free list), stop at an
  overflow, and read nothing on the host;
* three steps (the stash profiles, allocates, then runs steady) at PP 1 and at PP 2 x VPP 2: losses and every
  gradient of every step bitwise equal to the plain path with paged stash (and, at PP 1, to Megatron-Core's own plan,
  to the plain path without it, and with full recompute in both: the replay commits each expert group again, as the
  plain path's checkpoint does, and the stash keeps to the order it recorded); pages really moved, in an order of
  their own (the paired one), and a steady step of the plan reads nothing on the host;
* an overflowed step (a stash too small, or tokens over HybridEP's budget) sets the same flags in both arms, and
  Megatron-Core's ``PagedStashRunner`` reruns it on HybridEP's dynamic path in both, with the same numbers: the plan
  does not put the capacity factor the runner cleared back (``McoreRouting``);
* the engine, which never starts a paged-stash step, refuses it.
"""

import random
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from .bitwise import assert_steps_bitwise
from .host_reads import spy
from .local_ranks import run_local_ranks
from .mcore_cpu import init_megatron, install_cpu_stubs
from .mcore_models import McoreCase
from .paged_stash_kernels import LAUNCHES, copy_kernel, install_paged_stash_kernels, pop_kernel

HYBRIDEP = dict(dispatcher="flex", flex_backend="hybridep", topk=1, steps=3, microbatches=4)
PP1 = McoreCase(**HYBRIDEP, config=(("num_moe_experts", 2),))  # one local expert per rank
PIPELINED = McoreCase(**HYBRIDEP, layer_freq=(1,) * 8)  # two expert groups per chunk, two local experts per rank
# Full recompute of both layers as one segment: the replay commits each group again, and its first layer is paged out
# while the second replays.
RECOMPUTE = ("uniform", 2)
PAGE, HIDDEN = 4, 3

# ---- the kernel stand-ins -------------------------------------------------------------------------------------


class _Rings:
    """A buffer's state as Megatron-Core keeps it (device and host rings of page ids, heads, tails), and a plain
    Python free list beside it: what the kernels must do."""

    def __init__(self, device_pages: int, host_pages: int):
        self.cap = [device_pages, host_pages]
        self.device = torch.full((device_pages * PAGE, HIDDEN), float("nan"))
        self.host = torch.full((host_pages * PAGE, HIDDEN), float("nan")) if host_pages else None
        self.free = [torch.arange(device_pages), torch.arange(host_pages)]
        self.head, self.tail = torch.zeros(2, dtype=torch.int64), torch.tensor(self.cap)
        self.capacity = torch.tensor(self.cap)
        self.overflow, self.host_spill = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        # the reference
        self.ref_free = [list(range(device_pages)), list(range(host_pages))]
        self.ref_head, self.ref_tail, self.ref_overflow = [0, 0], list(self.cap), 0
        self.reads = []  # host reads the launches made

    def push(self, src_TH: torch.Tensor, n: int, grid: int = 2) -> dict:
        """``offload_to_stash``'s launch; returns the tensor's record (and checks it against the reference)."""
        record = torch.zeros(-(-src_TH.shape[0] // PAGE), dtype=torch.int64)
        spilled, new_head = torch.zeros(1, dtype=torch.int64), torch.full((2,), -7, dtype=torch.int64)
        host, count = self.host if self.host is not None else self.device, torch.tensor([n])
        with spy() as reads:
            copy_kernel[(grid,)](
                src_TH.reshape(-1), self.device, host, count, *self.free, self.head, self.tail, self.capacity,
                record, self.overflow, self.host_spill, spilled, new_head, PAGE_SIZE=PAGE, HIDDEN_SIZE=HIDDEN,
                BLOCK_SIZE=1024, HAS_HOST_BUFFER=int(self.host is not None),
            )  # fmt: skip
        self.reads += reads
        if grid == 0:
            assert new_head.tolist() == [-7, -7]  # no program ran
            return {}
        self.head.copy_(new_head)
        pages, ring, expected = -(-n // PAGE), None, 0
        if not self.ref_overflow:
            fits = [self.ref_tail[r] - self.ref_head[r] >= pages for r in (0, 1)]
            ring = 0 if fits[0] else 1 if fits[1] and self.host is not None else None
            self.ref_overflow = int(ring is None)
            expected = 1 if ring != 0 else 0
        ids = []
        if ring is not None:
            ids = [self.ref_free[ring][(self.ref_head[ring] + s) % self.cap[ring]] for s in range(pages)]
            self.ref_head[ring] += pages
        assert self.head.tolist() == self.ref_head and self.overflow.item() == self.ref_overflow
        assert spilled.item() == expected and record[: len(ids)].tolist() == ids and not record[len(ids) :].any()
        return {"record": record, "spilled": spilled, "n": n, "src": src_TH, "ring": ring}

    def pop(self, pushed: dict, grid: int = 3) -> torch.Tensor:
        """``reload_from_stash``'s launch; returns the rows read back (and checks the free list against the
        reference: each page back in pop order)."""
        dst_TH = torch.full_like(pushed["src"], -1.0)
        new_tail = torch.empty(2, dtype=torch.int64)
        host, count = self.host if self.host is not None else self.device, torch.tensor([pushed["n"]])
        with spy() as reads:
            pop_kernel[(grid,)](
                self.device, host, dst_TH.reshape(-1), count, pushed["record"], pushed["spilled"], self.overflow,
                *self.free, self.tail, self.capacity, new_tail, PAGE_SIZE=PAGE, HIDDEN_SIZE=HIDDEN, BLOCK_SIZE=1024,
            )  # fmt: skip
        self.reads += reads
        self.tail.copy_(new_tail)
        ring, n = pushed["ring"], pushed["n"]
        if not self.ref_overflow and ring is not None:
            for s in range(-(-n // PAGE)):
                self.ref_free[ring][(self.ref_tail[ring] + s) % self.cap[ring]] = pushed["record"][s].item()
            self.ref_tail[ring] += -(-n // PAGE)
        assert self.tail.tolist() == self.ref_tail
        assert [ring.tolist() for ring in self.free] == self.ref_free
        return dst_TH


def test_the_kernel_stand_ins_page_rows_out_and_back_as_a_plain_free_list():
    """Random pushes and pops in any order (as the stash's groups pop in backward order): each pop returns the pushed
    rows exactly and leaves the rest; pages return to their ring in pop order, are handed out again after the ring
    wraps, spill to the host ring when the device ring is full; no launch reads on the host."""
    rng = random.Random(52)
    rings = _Rings(device_pages=5, host_pages=3)
    live, pushes, spills = [], 0, 0
    for _ in range(120):
        if live and (rng.random() < 0.5 or len(live) > 3):
            pushed = live.pop(rng.randrange(len(live)))
            dst_TH = rings.pop(pushed)
            n = pushed["n"]
            assert torch.equal(dst_TH[:n], pushed["src"][:n]) and (dst_TH[n:] == -1.0).all()
            continue
        n = rng.randrange(0, 3 * PAGE + 1)
        needed = -(-n // PAGE)
        if needed > rings.ref_tail[0] - rings.ref_head[0] and needed > rings.ref_tail[1] - rings.ref_head[1]:
            continue  # the overflow has its own test
        pushed = rings.push(torch.randn(3 * PAGE, HIDDEN), n)
        spills += pushed["ring"] == 1
        pushes += 1
        live.append(pushed)
    assert rings.reads == []
    assert rings.ref_head[0] > 2 * rings.cap[0] and spills and rings.host_spill.item() == 1  # it wrapped, and spilled
    assert pushes > 40


def test_an_overflow_stops_every_later_copy_and_pop():
    rings = _Rings(device_pages=2, host_pages=0)
    first = rings.push(torch.randn(2 * PAGE, HIDDEN), 2 * PAGE)  # both pages
    buffer = rings.device.clone()
    second = rings.push(torch.randn(2 * PAGE, HIDDEN), 1)  # no page left, no host ring: overflow
    assert rings.overflow.item() == 1 and second["spilled"].item() == 1 and rings.head.tolist() == [2, 0]
    assert torch.equal(rings.device.nan_to_num(), buffer.nan_to_num())
    assert (rings.pop(first) == -1.0).all()  # sticky: the pop of rows stashed before it is a no-op too
    assert rings.tail.tolist() == [2, 0] and rings.free[0].tolist() == [0, 1]
    third = rings.push(torch.randn(PAGE, HIDDEN), PAGE)
    assert not third["record"].any() and rings.head.tolist() == [2, 0]
    assert rings.push(torch.randn(PAGE, HIDDEN), PAGE, grid=0) == {}  # a launch of no programs writes nothing


def test_a_host_spilled_tensor_with_no_host_ring_pops_nothing():
    rings = _Rings(device_pages=1, host_pages=0)
    pushed = rings.push(torch.randn(PAGE, HIDDEN), PAGE)
    pushed["spilled"].fill_(1)  # as if its copy had gone to a host ring
    rings.ref_overflow = 1  # the reference frees nothing either
    assert (rings.pop(pushed) == -1.0).all() and rings.tail.tolist() == [1, 0]


# ---- McoreRouting: only what the dispatcher's steps write is put back --------------------------------------------


def test_a_setting_changed_between_steps_is_not_put_back():
    """Megatron-Core's ``PagedStashRunner`` clears the HybridEP manager's capacity factor between two tries of a step
    (the rerun on HybridEP's dynamic path) and puts it back after: the plan's per-microbatch routing state must not
    undo either, while each microbatch in flight still gets its own routing state back."""
    from megatron.bridge.training.ep_overlap.mcore.layer import McoreRouting, StepWritten, _attributes

    manager = SimpleNamespace(moe_expert_rank_capacity_factor=1.5, num_permuted_tokens=None, handle=None)
    dispatcher = SimpleNamespace(_comm_manager=manager, hidden_shape=None)
    start = McoreRouting.of(dispatcher, StepWritten())

    def preprocess(name: str) -> McoreRouting:
        start.restore()
        before = _attributes(dispatcher)
        manager.num_permuted_tokens, dispatcher.hidden_shape = f"{name} rows", f"{name} shape"
        return McoreRouting.of(dispatcher, start.written, before)

    a = preprocess("a")
    b = preprocess("b")  # a is in flight
    manager.moe_expert_rank_capacity_factor = None  # the runner's fallback, between two steps
    with a.active():
        assert (manager.num_permuted_tokens, dispatcher.hidden_shape) == ("a rows", "a shape")
        assert manager.moe_expert_rank_capacity_factor is None
        manager.handle = "a handle"
    with b.active():
        assert (manager.num_permuted_tokens, manager.handle) == ("b rows", None)
    manager.moe_expert_rank_capacity_factor = 1.5  # the runner puts it back after a good try
    start.restore()
    a.restore()
    assert manager.moe_expert_rank_capacity_factor == 1.5 and manager.handle == "a handle"
    assert start.written.manager == {"num_permuted_tokens", "handle"}


# ---- under Megatron-Core's driver -----------------------------------------------------------------------------


def _prepare(model, models: list, *, stash: bool = True, capacity: float = 4.0, factor: float = 4.0) -> None:
    from .paged_stash_experts import enable_paged_stash, use_stashed_experts
    from .static_hybridep import make_static

    make_static(model, capacity)
    use_stashed_experts(model)
    if stash:
        enable_paged_stash(model, factor=factor)
    models.append(model)


class _EachStep:
    """Around each of ``run_arm``'s steps: the gradients once its backward ran (every step's), and on the last
    step of the plan, the host reads."""

    def __init__(self, models: list, steps: int, watch: bool):
        self.models, self.steps, self.watch = models, steps, watch
        self.grads, self.reads = [], None

    @contextmanager
    def __call__(self):
        last = len(self.grads) == self.steps - 1
        with spy() if self.watch and last else _nothing() as reads:
            yield
        if reads is not None:
            self.reads = list(reads)
        named = [(f"chunk{v}.{n}", p) for v, m in enumerate(self.models) for n, p in m.named_parameters()]
        self.grads.append({n: p.grad.clone() for n, p in named if p.grad is not None})


@contextmanager
def _nothing():
    yield None


def _install() -> None:
    """The CPU stand-ins (streams, HybridEP's static contract, the kernels), and HybridEP's budget unaligned: the
    fused grouped GEMM's 256-row alignment would dwarf these 16 tokens per rank, so the budget here is tokens x
    top-k x capacity factor, as at scale (where 256 rows are a rounding)."""
    install_cpu_stubs()
    from megatron.core.transformer.moe import token_dispatcher

    from .static_hybridep import install_static_hybridep

    install_static_hybridep()
    install_paged_stash_kernels()
    token_dispatcher.get_align_size_for_quantization = lambda config: 1


def _train(rank: int, world: int, case: McoreCase, pipeline: bool, arms: tuple) -> dict:
    _install()
    init_megatron(case.world, *((2, 2) if pipeline else ()))
    from .mcore_arms import run_arm
    from .paged_stash_experts import fresh_stash_manager

    out = {}
    for arm in arms:
        mode, _, variant = arm.partition("-")
        manager, models = fresh_stash_manager(), []
        LAUNCHES.clear()
        each = _EachStep(models, case.steps, watch=mode == "hook")
        prepare = partial(_prepare, models=models, stash=variant != "off")
        arm_case = replace(case, full_recompute=RECOMPUTE) if variant == "recompute" else case
        result = run_arm(mode, arm_case, prepare=prepare, pipeline=pipeline, around_step=each)
        out[arm] = {
            "losses": result["losses"],
            "grads": each.grads,
            "reads": each.reads,
            "launches": dict(LAUNCHES),
            "status": manager.status,
            "schedule": list(manager._pp_schedule or ()),
            "overflow": None if manager.overflow is None else manager.overflow.item(),
        }
    return out


def _paired(schedule: list[int]) -> bool:
    """Whether another microbatch's expert group runs forward between two of one microbatch's backward: the paired
    order (a code is ``vp stage * 10^6 + group * 1000 + microbatch``, negative for a backward)."""
    triples = zip(schedule, schedule[1:], schedule[2:])
    return any(b1 < 0 < f and b2 < 0 and -b1 % 1000 == -b2 % 1000 != f % 1000 for b1, f, b2 in triples)


@pytest.mark.parametrize(
    "pipeline, arms",
    [(False, ("plain", "hook", "mcore", "plain-off", "plain-recompute", "hook-recompute")), (True, ("plain", "hook"))],
    ids=["pp1", "pp2-vpp2"],
)
def test_paged_stash_under_the_plan_is_bitwise_equal_to_the_plain_path(pipeline, arms):
    case = PIPELINED if pipeline else PP1
    for outcome in run_local_ranks(_train, 4 if pipeline else 2, (case, pipeline, arms)):
        got, rank = outcome.result, outcome.rank
        for arm in arms[1:]:
            assert_steps_bitwise(got["plain"], got[arm], case.steps, rank)
        for arm in (a for a in arms if not a.endswith("-off")):
            stash = got[arm]
            # the third step ran steady: captured order, pages out and back, no overflow
            assert stash["status"] == "captured" and stash["overflow"] == 0, (arm, stash["status"])
            assert stash["launches"].get("copy") and stash["launches"].get("pop"), (arm, stash["launches"])
        hook, plain = got["hook"], got["plain"]
        # the stash recorded the plan's own (paired) order in its first step, and the later steps kept to it
        assert _paired(hook["schedule"]) and not _paired(plain["schedule"]), hook["schedule"]
        for arm in (a for a in arms if a.startswith("hook")):
            assert got[arm]["reads"] == [], (arm, got[arm]["reads"])  # a steady step of the plan: no host read


# ---- an overflowed step: Megatron-Core's fallback ----------------------------------------------------------------

# name -> (capacity factor, stash buffer factor): a stash too small for the step, or a budget too small for the tokens
FALLBACKS = {"stash-overflow": (4.0, 0.25), "over-budget": (0.25, 4.0)}


def _fallback(rank: int, world: int, scenario: str) -> dict:
    _install()
    init_megatron(world)
    return {arm: _fallback_arm(arm, *FALLBACKS[scenario]) for arm in ("plain", "hook")}


def _fallback_arm(arm: str, capacity: float, factor: float) -> dict:
    """``PP1``'s steps through Megatron-Core's ``PagedStashRunner`` (Megatron-Bridge's outermost wrapper of the
    forward-backward function): per step, losses, gradients, and each try's flags and HybridEP settings."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.paged_stash import PagedStashRunner, check_paged_stash_overflow

    from megatron.bridge.training.ep_overlap.mcore import use_ep_overlap_schedule

    from .fake_deepep import CALLS
    from .mcore_arms import _data
    from .mcore_models import build_model
    from .paged_stash_experts import fresh_stash_manager
    from .test_mcore_hook import MICRO_BATCH, SEQ, bridge_style_forward_step

    fresh_stash_manager()
    model = build_model(PP1)
    config = model.config
    _prepare(model, [], capacity=capacity, factor=factor)
    managers = [m.token_dispatcher._comm_manager for m in model.modules() if hasattr(m, "token_dispatcher")]
    if arm == "hook":
        config.overlap_moe_expert_parallel_comm = True
        use_ep_overlap_schedule([model], timeout=timedelta(seconds=60))
    model.zero_grad_buffer = partial(model.zero_grad, set_to_none=True)  # what the runner's rerun calls (DDP's)
    tries = []

    def attempt(**kwargs):
        dynamic = CALLS["dispatch_dynamic"]
        factors = [m.moe_expert_rank_capacity_factor for m in managers]
        store = get_forward_backward_func()(**kwargs)
        tries.append(
            {
                "stash_overflow": bool(check_paged_stash_overflow().any()),
                "over_budget": any(bool(m.over_budget.any()) for m in managers),
                "capacity": factors,
                "dynamic_dispatches": CALLS["dispatch_dynamic"] - dynamic,
                "paged_stash": config.moe_paged_stash,
            }
        )
        return store

    runner = PagedStashRunner(config, False, [model], None, attempt)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, grads, per_step = [], [], []
    for step in range(PP1.steps):
        tries.clear()
        store = runner(
            forward_step_func=bridge_style_forward_step, data_iterator=iter(_data(PP1, step)), model=[model],
            num_microbatches=PP1.microbatches, seq_length=SEQ, micro_batch_size=MICRO_BATCH, forward_only=False,
        )  # fmt: skip
        losses.append(torch.stack([logged["lm loss"] for logged in store]))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        per_step.append(list(tries))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"losses": losses, "grads": grads, "tries": per_step}


@pytest.mark.parametrize("scenario", sorted(FALLBACKS))
def test_an_overflowed_step_falls_back_alike_in_both_arms(scenario):
    for outcome in run_local_ranks(_fallback, 2, (scenario,)):
        plain, hook = outcome.result["plain"], outcome.result["hook"]
        assert hook["tries"] == plain["tries"], (hook["tries"], plain["tries"])
        assert_steps_bitwise(plain, hook, PP1.steps, outcome.rank)
        capacity = FALLBACKS[scenario][0]
        for step, tries in enumerate(plain["tries"]):
            # the stash profiles in the first step (nothing to overflow), then overflows each step
            failed = step > 0 or scenario == "over-budget"
            assert len(tries) == 1 + failed, (step, tries)
            first = tries[0]
            assert first["capacity"] == [capacity] * 2 and first["paged_stash"] and first["dynamic_dispatches"] == 0
            assert (first["stash_overflow"], first["over_budget"]) == (
                failed and scenario == "stash-overflow",
                scenario == "over-budget",
            ), first
            if failed:  # the rerun: dynamic HybridEP (the factor cleared, not put back), no stash
                rerun = tries[1]
                assert rerun["capacity"] == [None] * 2 and not rerun["paged_stash"], rerun
                assert rerun["dynamic_dispatches"] > 0 and not rerun["stash_overflow"] and not rerun["over_budget"]


# ---- the engine ----------------------------------------------------------------------------------------------


@pytest.mark.lab
def test_the_engine_refuses_paged_stash_naming_the_driver_that_runs_it():
    from ep_overlap_lab.engine.step_hooks import step_problems

    config = SimpleNamespace(
        moe_paged_stash=True, experimental_attention_variant=None, experimental_attention_variant_loss_scale_func=None
    )
    (problem,) = step_problems(torch.nn.Linear(1, 1), config)
    assert problem.startswith("moe_paged_stash:") and "use_ep_overlap_schedule" in problem and "fix: " in problem
    config.moe_paged_stash = False
    assert step_problems(torch.nn.Linear(1, 1), config) == []
