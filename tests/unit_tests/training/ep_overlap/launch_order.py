"""Test-only: records, on one rank, the host's order of every lane and P2P event of a step (the schedule's
fingerprint), for the option combinations a test gives (``program_events.py`` derives the same events from the
program).

Events, one line each, in the order the host issued them:
    ``compute <node> L<layer> m<unit> <phase>``   a compute node starts
    ``launch <op> L<layer> m<unit> <phase>``      the host asks for an all-to-all (on the host or off it)
    ``record <op> L<layer> m<unit> <phase>``      a comm record made on the host outside a launch (a split-size
                                                  exchange starting, a blocking plain-path all-to-all, a P2P send
                                                  waited for at the end of the step)
    ``wait <what>``                               the host waits for an all-to-all or a P2P receive
    ``p2p post|take|send <kind>m<mb>c<chunk>r<peer>`` and ``p2p finish``: pipeline transfers
    ``run F<vp>m<mb> B<vp>m<mb>`` / ``hook <name> <vp>``: Megatron-Core's driver calling the plan and its P2P hooks

The hooks are installed on the lane, P2P and plan classes inside a forked rank only. Events from threads other
than the host's (a helper thread launching off the host) are not the host's order and are left out.

:func:`as_a_device_lane` makes a rank's CPU lanes the device-lane stand-in: they issue the program's ops in the order
the CUDA lane issues them (``IssueOrder.DEVICE``), while their compute still runs on the host.
"""

import functools
import importlib
import itertools
import threading
from datetime import timedelta

import torch

from .program_events import key

EVENTS: list[str] = []
_state = threading.local()


def _on_host() -> bool:
    return threading.current_thread() is threading.main_thread()


def _nested(fn):
    """Marks the call as one event: calls it makes into other hooked methods are not events of their own."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        depth = getattr(_state, "depth", 0)
        _state.depth = depth + 1
        try:
            return fn(depth == 0 and _on_host(), *args, **kwargs)
        finally:
            _state.depth = depth

    return wrapper


def _tag(pending, label: str):
    for one in pending if isinstance(pending, list) else [pending]:
        one._golden = label
    return pending


def install() -> None:
    """Hooks the lane, P2P (the lab engine's, where the lab is installed) and Megatron-Core plan classes of this
    process (a forked rank)."""
    from megatron.bridge.training.ep_overlap.mcore import hook as mcore_hook
    from megatron.bridge.training.ep_overlap.runtime import lanes

    compute = lanes._Lane.compute

    def hooked_compute(self, node, layer, microbatch):
        if _on_host():
            EVENTS.append(f"compute {node} L{layer} m{microbatch} {self.recorder.phase}")
        return compute(self, node, layer, microbatch)

    lanes._Lane.compute = hooked_compute

    def launcher(original):
        @_nested
        def hooked(top, self, *args, op, layer, microbatch, **kwargs):
            if top:
                EVENTS.append(f"launch {op} L{layer} m{microbatch} {self.recorder.phase}")
            return _tag(
                original(self, *args, op=op, layer=layer, microbatch=microbatch, **kwargs),
                f"{op} L{layer} m{microbatch}",
            )

        return hooked

    off_host = _lab_engine_module("off_host_lane")
    hooked_launches = [(lanes._Lane, "launch"), (lanes.CpuLane, "all_to_all")]
    if off_host is not None:
        hooked_launches += [(off_host.OffHostCpuLane, "launch"), (off_host.OffHostCpuLane, "all_to_all")]
    for cls, name in hooked_launches:
        setattr(cls, name, launcher(cls.__dict__[name]))
    record_comm = lanes._Lane.record_comm

    @_nested
    def hooked_record(top, self, op, layer, microbatch, *args, **kwargs):
        if top:
            EVENTS.append(f"record {op} L{layer} m{microbatch} {self.recorder.phase}")
        return record_comm(self, op, layer, microbatch, *args, **kwargs)

    lanes._Lane.record_comm = hooked_record

    def waiter(original):
        @_nested
        def hooked(top, self):
            label = getattr(self, "_golden", None)
            if top and label is not None and not getattr(self, "_golden_waited", False):
                EVENTS.append(f"wait {label}")
                self._golden_waited = True
            return original(self)

        return hooked

    for cls in (lanes.Pending,) + (() if off_host is None else (off_host._LaunchedLater,)):
        cls.wait = waiter(cls.__dict__["wait"])

    def transfer(t) -> str:
        return f"{t.kind}m{t.microbatch}c{t.chunk}r{t.peer}"

    _hook_engine_p2p(transfer)

    run = mcore_hook.EPOverlapSchedulePlan.run

    def logged(name, hook):
        if hook is None:
            return None

        def call(*args):
            EVENTS.append(f"hook {name} {args[-1]}")
            return hook(*args)

        return call

    def hooked_run(f_plan, b_plan, b_grad=None, pre_forward=None, pre_backward=None, post_forward=None,
                   post_backward=None):  # fmt: skip
        which = [f"{side}{plan.vp_stage}m{plan.nodes.mb}" for side, plan in (("F", f_plan), ("B", b_plan)) if plan]
        EVENTS.append("run " + " ".join(which))
        return run(
            f_plan, b_plan, b_grad, logged("pre_forward", pre_forward), logged("pre_backward", pre_backward),
            logged("post_forward", post_forward), logged("post_backward", post_backward),
        )  # fmt: skip

    mcore_hook.EPOverlapSchedulePlan.run = staticmethod(hooked_run)


def _lab_engine_module(name: str):
    """The lab engine's module ``name``, or None in upstream's tree (no lab, no engine to record)."""
    try:
        return importlib.import_module(f"ep_overlap_lab.engine.{name}")
    except ModuleNotFoundError:
        return None


def _hook_engine_p2p(transfer) -> None:
    """The lab engine's pipeline P2P, recorded (Megatron-Core's driver does its own P2P; the hook records none)."""
    p2p = _lab_engine_module("p2p")
    if p2p is None:
        return

    post, take, send, finish = (p2p.PipelineP2P.__dict__[n] for n in ("post", "take", "send", "finish"))

    def hooked_post(self, transfers, *args, **kwargs):
        EVENTS.extend(f"p2p post {transfer(t)}" for t in transfers if t not in self._recvs)
        return post(self, transfers, *args, **kwargs)

    def hooked_take(self, t):
        EVENTS.append(f"p2p take {transfer(t)}")
        return _tag(take(self, t), f"p2p {transfer(t)}")

    def hooked_send(self, t, tensor):
        EVENTS.append(f"p2p send {transfer(t)}")
        return send(self, t, tensor)

    def hooked_finish(self):
        EVENTS.append("p2p finish")
        return finish(self)

    p2p.PipelineP2P.post, p2p.PipelineP2P.take = hooked_post, hooked_take
    p2p.PipelineP2P.send, p2p.PipelineP2P.finish = hooked_send, hooked_finish


def take_events() -> list[str]:
    events = list(EVENTS)
    EVENTS.clear()
    return events


# ---- recording a step ----------------------------------------------------------------------------------------


def run_engine(engine, data, options: dict) -> list[str]:
    """One step (forward-only or training); with the auto attention-wgrad window, only the first (plain) one."""
    take_events()
    engine.step(data, forward_only=options["forward_only"])
    return take_events()


def engine_kwargs(options: dict) -> dict:
    return {k: v for k, v in options.items() if k != "forward_only"}


TIMEOUT = timedelta(seconds=60)


def as_a_device_lane() -> None:
    """This process's CPU lanes issue the program's ops as the CUDA lane does (the device-lane stand-in)."""
    from megatron.bridge.training.ep_overlap.program.interpreter import IssueOrder
    from megatron.bridge.training.ep_overlap.runtime import lanes

    lanes.CpuLane.issue = IssueOrder.DEVICE


def _reference_config(pp: int, **fields):
    from ep_overlap_lab.moe_gpt import MoEGPTConfig

    freq = [1, 0, 1] if pp == 1 else [1, 0, 1, 1]
    return MoEGPTConfig(
        num_layers=len(freq), hidden_size=16, num_attention_heads=2, ffn_hidden_size=16, num_moe_experts=4,
        moe_ffn_hidden_size=8, moe_router_topk=2, moe_layer_freq=freq, expert_model_parallel_size=2,
        seq_length=4, vocab_size=32, add_bias_linear=False, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=2 if pp > 1 else None, pipeline_dtype=torch.float32 if pp > 1 else None,
        **fields,
    )  # fmt: skip


def reference_orders(rank: int, world: int, pp: int, microbatch_counts: tuple, combinations: list[dict]) -> dict:
    """The reference MoE GPT (3 layers at PP 1, 4 at PP 2 x VPP 2), EP 2, one step per option set."""
    from ep_overlap_lab.moe_gpt import MoEGPTModel, build_pipeline_chunks

    from .local_ranks import init_ep_groups

    install()
    config = _reference_config(pp)
    groups = init_ep_groups(2, TIMEOUT, pipeline_size=pp)

    def build():
        return build_pipeline_chunks(config, groups, 1, groups.pp_rank) if pp > 1 else MoEGPTModel(config, groups, 1)

    return _engine_orders(groups, microbatch_counts, combinations, build, vocab=32, shape=(2, 4))


def reference_on_both_lanes(rank: int, world: int, microbatches: int, combinations: list[dict]) -> dict:
    """The reference MoE GPT at PP 1 (EP 2), one step per option set on the CPU lane as it is (a host lane), then on
    the device-lane stand-in, each on a fresh model: the events of both, and whether the losses and every gradient
    are bitwise the same. A combination's ``recompute`` (method, layers) turns full recompute on."""
    from ep_overlap_lab.engine import EPOverlapEngine
    from ep_overlap_lab.moe_gpt import MoEGPTModel
    from megatron.bridge.training.ep_overlap.runtime import lanes

    from .local_ranks import init_ep_groups

    install()
    groups = init_ep_groups(2, TIMEOUT)
    gen = torch.Generator().manual_seed(microbatches * 10 + groups.ep_rank)
    data = [tuple(torch.randint(0, 32, (2, 2, 4), generator=gen)) for _ in range(microbatches)]
    host = lanes.CpuLane.issue
    out = {}
    for options in combinations:
        options = dict(options)
        method, layers = options.pop("recompute", (None, None))
        recompute = dict(recompute_granularity="full", recompute_method=method, recompute_num_layers=layers)
        config = _reference_config(1, **(recompute if method else {}))
        runs = {}
        for lane in ("host", "device"):
            if lane == "device":
                as_a_device_lane()
            model = MoEGPTModel(config, groups, 1)
            engine = EPOverlapEngine(model, groups, **engine_kwargs(options))
            take_events()
            result = engine.step(data, forward_only=options["forward_only"])
            grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
            runs[lane] = (take_events(), result.losses, grads)
            lanes.CpuLane.issue = host
        (host_events, host_losses, host_grads), (device_events, device_losses, device_grads) = runs.values()
        same = len(host_grads) == len(device_grads) and all(
            torch.equal(a, b) for a, b in zip(host_losses + host_grads, device_losses + device_grads)
        )
        out[key(options | ({"recompute": method} if method else {}))] = {
            "host": host_events, "device": device_events, "bitwise": same, "grads": len(host_grads),
        }  # fmt: skip
    return out


def mcore_driver_on_a_device_lane(rank: int, world: int, case) -> dict:
    """``test_mcore_hook.train_with_mcore_driver`` (Megatron-Core's driver: the plain arm, then ours through the
    hook) with this rank's CPU lanes the device-lane stand-in."""
    from .test_mcore_hook import train_with_mcore_driver

    as_a_device_lane()
    return train_with_mcore_driver(rank, world, case)


def _engine_orders(groups, microbatch_counts, combinations, build, *, vocab: int, shape: tuple) -> dict:
    """One step per option combination on a fresh model from ``build()``, for each microbatch count."""
    from ep_overlap_lab.engine import EPOverlapEngine

    out = {}
    for n in microbatch_counts:
        gen = torch.Generator().manual_seed(n * 10 + groups.ep_rank)
        data = [tuple(torch.randint(0, vocab, (2, *shape), generator=gen)) for _ in range(n)]
        for options in combinations:
            engine = EPOverlapEngine(build(), groups, **engine_kwargs(options))
            out[f"N={n},{key(options)}"] = run_engine(engine, data, options)
    return out


def mcore_engine_orders(rank: int, world: int, pp: int, microbatch_counts: tuple, combinations: list[dict]) -> dict:
    """A Megatron-Core GPTModel (local specs) through the engine: whole at PP 1, chunks at PP 2 x VPP 2."""
    from .mcore_cpu import init_megatron, install_cpu_stubs

    install_cpu_stubs()
    init_megatron(2, pp, 2 if pp > 1 else None)
    from megatron.bridge.training.ep_overlap.mcore import McoreGPTChunk, mcore_ep_groups

    from .mcore_models import McoreCase, build_gpt
    from .mcore_stages import build_plans

    install()
    groups = mcore_ep_groups(TIMEOUT)
    case = McoreCase(layer_freq=(1, 0, 1) if pp == 1 else (1, 0, 1, 1))

    def build():
        return build_plans(case, pp, 2) if pp > 1 else McoreGPTChunk(build_gpt(case))

    return _engine_orders(groups, microbatch_counts, combinations, build, vocab=64, shape=(2, 8))


def mcore_hook_orders(
    rank: int, world: int, pp: int, microbatches: int, vpp: int | None = 2, device_lane: bool = False
) -> dict:
    """Megatron-Core's own driver running the plan through the pre-wrap hook: PP 1, its interleaved schedule, or
    (``vpp`` None) the plain 1F1B pipeline through this project's ``get_forward_backward_func``; with
    ``device_lane`` on the device-lane stand-in."""
    from .mcore_cpu import init_megatron, install_cpu_stubs

    if device_lane:
        as_a_device_lane()

    install_cpu_stubs()
    init_megatron(2, pp, vpp if pp > 1 else None)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron.bridge.training.ep_overlap.mcore import get_forward_backward_func as ours
    from megatron.bridge.training.ep_overlap.mcore import use_ep_overlap_schedule

    from .mcore_models import McoreCase, build_gpt
    from .mcore_stages import build_plans
    from .test_mcore_hook import MICRO_BATCH, SEQ, bridge_style_forward_step

    install()
    case = McoreCase(layer_freq=(1, 0, 1) if pp == 1 else (1, 0, 1, 1))
    chunks = vpp if pp > 1 and vpp else 1
    # Without virtual stages the call sets overlap_p2p_comm itself (Megatron-Core's 1F1B refuses it in the config).
    p2p_modes = (False, True) if chunks > 1 else (False,)
    out = {}
    for delay, window, overlap_p2p in itertools.product((False, True), (1, 2), p2p_modes):
        models = [plan.model for plan in build_plans(case, pp, vpp)] if pp > 1 else [build_gpt(case)]
        config = models[0].config
        config.overlap_moe_expert_parallel_comm, config.delay_wgrad_compute = True, delay
        config.batch_p2p_comm, config.overlap_p2p_comm = False, overlap_p2p
        use_ep_overlap_schedule(models, timeout=TIMEOUT, attention_wgrad_window=window)
        gen = torch.Generator().manual_seed(7)
        data = [tuple(torch.randint(0, 64, (2, MICRO_BATCH, SEQ), generator=gen)) for _ in range(microbatches)]
        take_events()
        (ours if pp > 1 and chunks == 1 else get_forward_backward_func)()(
            forward_step_func=bridge_style_forward_step,
            data_iterator=[iter(list(data)) for _ in models] if chunks > 1 else iter(data),
            model=models,
            num_microbatches=microbatches,
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            forward_only=False,
        )
        out[f"N={microbatches},delay_wgrad={delay},attention_wgrad_window={window},overlap_p2p_comm={overlap_p2p}"] = (
            take_events()
        )
    return out
