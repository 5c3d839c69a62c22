"""A step with a static-shape flex backend reads nothing on the host and issues the same operations every time.

Full-iteration CUDA graphs capture a whole step and replay it: nothing in the step may wait for the device (a host
read, a synchronize), and the step's operations, on their shapes, must not depend on the data. With HybridEP given a
capacity factor (``static_hybridep.py``, its static contract on gloo), two CPU ranks (EP 2, one local expert: the local
``SequentialMLP`` reads its split sizes on the host with more) check, after a first step:

* **no host read** in a step of this project's plan under Megatron-Core's driver (``host_reads.spy``), and none in
  Megatron-Core's own plan with the same stand-in: the control that shows the spy reads what matters. The
  ``alltoall`` dispatcher keeps its host read of the split sizes, and the spy sees it;
* **the same operations every step**: the aten operations a step issues on the host with their shapes and dtypes,
  and the lane's launches and waits, equal step after step and for other data; with ``alltoall`` they are not (its
  all-to-alls take their shapes from the routing);
* **a step under the capture stand-in** (any host read raises), numbers equal to the plain path's.
"""

from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .bitwise import assert_bitwise
from .host_reads import capturing, spy
from .local_ranks import run_local_ranks
from .mcore_cpu import init_megatron, install_cpu_stubs
from .mcore_models import McoreCase

STATIC = McoreCase(dispatcher="flex", flex_backend="hybridep", topk=1, steps=3, config=(("num_moe_experts", 2),))
ALLTOALL = replace(STATIC, dispatcher="alltoall")


class _Issued(TorchDispatchMode):
    """The aten operations issued, with their tensors' shapes and dtypes."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        shapes = tuple(
            (tuple(a.shape), str(a.dtype)) if isinstance(a, torch.Tensor) else None
            for a in torch.utils._pytree.tree_leaves((args, kwargs))
        )
        self.ops.append((str(func), shapes))
        return func(*args, **kwargs)


def _per_step(arm: str, case: McoreCase, watch) -> tuple[dict, list]:
    """``case.steps`` steps of ``arm``; ``watch(step)`` is the context around each step (its value kept)."""
    from .mcore_arms import run_arm
    from .static_hybridep import install_static_hybridep, make_static

    if case.dispatcher == "flex":
        install_static_hybridep()
    seen, step = [], iter(range(case.steps))

    class _Around:
        def __enter__(self):
            self.context = watch(next(step))
            seen.append(self.context.__enter__())

        def __exit__(self, *exc):
            return self.context.__exit__(*exc)

    prepare = make_static if case.dispatcher == "flex" else None
    return run_arm(arm, case, prepare=prepare, around_step=_Around), seen


def _host_reads(rank: int, world: int, arm: str, case: McoreCase) -> list:
    install_cpu_stubs()
    init_megatron(world)
    from contextlib import nullcontext

    _, seen = _per_step(arm, case, lambda step: spy() if step else nullcontext())  # step 0 builds what it needs
    return [list(records) for records in seen[1:]]


@pytest.mark.parametrize("arm", ["hook", "mcore"])
def test_a_static_step_reads_nothing_on_the_host(arm):
    for outcome in run_local_ranks(_host_reads, 2, (arm, STATIC)):
        assert outcome.result == [[], []], outcome.result


def test_the_alltoall_dispatcher_keeps_its_host_read_of_the_split_sizes():
    for outcome in run_local_ranks(_host_reads, 2, ("hook", ALLTOALL)):
        reads = [where for step in outcome.result for _, where in step]
        assert reads and any("token_dispatcher.py" in where or "layer.py" in where for where in reads), reads


def _issued(rank: int, world: int, case: McoreCase) -> list:
    install_cpu_stubs()
    init_megatron(world)
    from .mcore_arms import run_arm  # noqa: F401 (the arm's own imports first)

    traces = []

    class _Trace:
        def __init__(self, step):
            self.mode = _Issued()

        def __enter__(self):
            self.mode.__enter__()
            return self.mode

        def __exit__(self, *exc):
            return self.mode.__exit__(*exc)

    result, seen = _per_step("hook", case, _Trace)
    recorder = result["models"][0].build_schedule_plan.recorder
    for mode in seen[1:]:
        traces.append(mode.ops)
    lane = [(r.op, str(r.phase)) for r in recorder.comm]
    return {"traces": traces, "lane": lane}


@pytest.mark.parametrize("case, same", [(STATIC, True), (ALLTOALL, False)], ids=["static-hybridep", "alltoall"])
def test_a_static_step_issues_the_same_operations_every_step_and_for_other_data(case, same):
    # _data seeds each step differently: steps 1 and 2 route other tokens.
    for outcome in run_local_ranks(_issued, 2, (case,)):
        first, second = outcome.result["traces"]
        assert first and (first == second) == same, (len(first), len(second))
        assert outcome.result["lane"]


def _captured(rank: int, world: int) -> dict:
    install_cpu_stubs()
    init_megatron(world)
    from contextlib import nullcontext

    arms = {}
    for arm, captured in (("plain", False), ("hook", True)):
        result, _ = _per_step(arm, STATIC, lambda step, on=captured: capturing() if step and on else nullcontext())
        arms[arm] = {"losses": result["losses"], "grads": result["grads"]}
    return arms


def test_a_static_step_runs_under_the_capture_stand_in_with_the_plain_paths_numbers():
    for outcome in run_local_ranks(_captured, 2):
        plain, hook = outcome.result["plain"], outcome.result["hook"]
        for step, (mine, theirs) in enumerate(zip(plain["losses"], hook["losses"])):
            assert_bitwise(mine, theirs, f"rank {outcome.rank} step {step} losses")
        for name, grad in plain["grads"].items():
            assert_bitwise(grad, hook["grads"][name], f"rank {outcome.rank} {name}")
