"""The full-iteration CUDA graph check (``full_iteration_graph_check.py``) on CPU: everything short of the GPU run.

``scripts/gpu_check.sh`` runs the check itself under torchrun on 2 or more GPUs with HybridEP. Here: the command line
(``--help``, refused step counts), the one-line skip without CUDA (status 0) and every other skip reason (the host's
answers stubbed), and the config the check trains: Megatron-Core builds it, and this project's rules accept it for a
graph of the whole step, which they refuse without the capacity factor that makes HybridEP's dispatch static.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from . import full_iteration_graph_check as check

SCRIPT = Path(__file__).with_name("full_iteration_graph_check.py")


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, env=base | (env or {})
    )


def test_help_describes_the_check():
    run = _run("--help")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage:") and "--warmup-steps" in run.stdout
    assert "full-iteration CUDA graph" in run.stdout


@pytest.mark.parametrize(
    "args, says",
    [
        (["--steps", "3", "--warmup-steps", "2"], "at least --warmup-steps + 2"),
        (["--warmup-steps", "0"], "--warmup-steps must be at least 1"),
        (["--hidden-size", "96"], "multiple of 64"),
        (["--capacity-factor", "0"], "must be positive"),
    ],
)
def test_step_counts_that_leave_no_replay_are_refused(args, says):
    run = _run(*args)
    assert run.returncode == 2 and says in run.stderr, run.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA: the check would not skip for that")
def test_without_cuda_it_skips_in_one_line_with_status_0():
    run = _run()
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        check.SKIP_PREFIX + "no CUDA device (it captures a CUDA graph of an NCCL run on 2 or more GPUs)"
    ]


def test_only_rank_0_prints_the_skip_line():
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the skip depends on its GPUs")
    run = _run(env={"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert run.returncode == 0 and run.stdout == "", run.stdout


def _gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_every_skip_reason_is_one_line(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    _gpus(monkeypatch, 1)
    assert check.skip_reason() == "needs 2 or more GPUs (one NCCL rank each, EP = ranks); this host has 1"
    _gpus(monkeypatch, 2)
    assert "run it under torchrun" in check.skip_reason()
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert check.skip_reason() == "needs one GPU per rank: 4 ranks, 2 GPUs"
    monkeypatch.setenv("WORLD_SIZE", "2")
    from megatron.core.transformer.moe import fused_a2a

    if fused_a2a.hybrid_ep_dispatch is None:  # as on a host without deep_ep's HybridEP
        assert check.skip_reason() == "deep_ep without HybridEP (Megatron-Core's fused_a2a.hybrid_ep_dispatch is None)"
    monkeypatch.setattr(fused_a2a, "hybrid_ep_dispatch", object())
    monkeypatch.setattr(check, "fused_experts_problem", lambda: "why not")
    reason = check.skip_reason()
    assert (
        reason == "the experts of a static-shape HybridEP step need Transformer Engine's graph-safe op fuser: why not"
    )
    monkeypatch.setattr(check, "fused_experts_problem", lambda: None)
    assert check.skip_reason() is None


def test_without_transformer_engine_the_fused_experts_are_missing():
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        assert "GroupedLinear and ScaledSReLU (TE 2.17 on) are not importable" in check.fused_experts_problem()
    else:
        pytest.skip("Transformer Engine is installed here")


def _fake_te(monkeypatch, *, public=None, private=None, cublaslt=130400, capability=(9, 0)) -> None:
    """Just enough of a Transformer Engine for ``fused_experts_problem``: the op fuser's ops, and the graph-safe
    predicate of a later (``public``) or an earlier (``private``) version, or none."""
    import types

    import megatron.core.utils  # first, with the real modules: Megatron-Core notes at import whether TE is there

    grouped = types.ModuleType("transformer_engine.pytorch.ops.basic.grouped_linear")
    grouped.GroupedLinear = type("GroupedLinear", (), {})
    if public is not None:
        grouped.is_op_fuser_grouped_tensor_path_supported = public
    if private is not None:
        grouped.GroupedLinear._is_graph_safe_path_supported = staticmethod(private)
    ops = types.ModuleType("transformer_engine.pytorch.ops")
    ops.GroupedLinear, ops.ScaledSReLU = grouped.GroupedLinear, object
    tex = types.ModuleType("transformer_engine_torch")
    tex.get_cublasLt_version = lambda: cublaslt
    modules = {
        "transformer_engine": types.ModuleType("transformer_engine"),
        "transformer_engine.pytorch": types.ModuleType("transformer_engine.pytorch"),
        "transformer_engine.pytorch.ops": ops,
        "transformer_engine.pytorch.ops.basic": types.ModuleType("transformer_engine.pytorch.ops.basic"),
        "transformer_engine.pytorch.ops.basic.grouped_linear": grouped,
        "transformer_engine_torch": tex,
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(megatron.core.utils, "get_te_version", lambda: "2.17.0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: capability)


def test_the_experts_need_transformer_engines_graph_safe_grouped_gemm(monkeypatch):
    asked = []

    def public(recipe, dtype):
        asked.append((recipe, dtype))
        return False

    _fake_te(monkeypatch, public=public)
    assert check.fused_experts_problem() == (
        "Transformer Engine 2.17.0 has no graph-safe grouped GEMM on this GPU (compute capability 9.0, or its "
        "cuBLASLt): its GroupedLinear op would read the per-expert counts on the host"
    )
    assert asked == [(None, torch.bfloat16)]  # bf16, no quantization recipe: what the check trains
    _fake_te(monkeypatch, public=lambda recipe, dtype: True)
    assert check.fused_experts_problem() is None


def test_earlier_versions_are_asked_their_own_predicate_and_cublaslts_requirement(monkeypatch):
    def private(*, with_quantized_compute, input_quantizers, dtype, single_grouped_weight):
        return not with_quantized_compute and dtype == torch.bfloat16 and not single_grouped_weight

    _fake_te(monkeypatch, private=private, cublaslt=130400, capability=(9, 0))
    assert check.fused_experts_problem() is None
    _fake_te(monkeypatch, private=private, cublaslt=130300, capability=(9, 0))  # Hopper needs cuBLASLt 13.4
    assert "no graph-safe grouped GEMM" in check.fused_experts_problem()
    _fake_te(monkeypatch, private=private, cublaslt=130300, capability=(10, 0))
    assert check.fused_experts_problem() is None
    # A version with neither predicate is newer than those read: the capture decides.
    _fake_te(monkeypatch)
    assert check.fused_experts_problem() is None


def test_the_default_capacity_factor_drops_no_token():
    args = check.parse_args([])
    for world in (2, 4, 8):
        factor = check.capacity_factor(args, world)
        tokens = args.seq_length * args.micro_batch_size
        # the most rows a rank can receive: every source token of every rank on min(topk, local experts) of its own
        most = world * tokens * min(args.topk, args.experts_per_rank)
        assert most <= check.permuted_budget(args, factor) and check.permuted_budget(args, factor) % 256 == 0
    assert check.capacity_factor(check.parse_args(["--capacity-factor", "1.5"]), 2) == 1.5


def _rules(config) -> None:
    from megatron.bridge.training.ep_overlap.options import EPOverlapOptions
    from megatron.bridge.training.ep_overlap.settings import resolve
    from megatron.bridge.training.moe_overlap_rules import use_bridge_schedule

    use_bridge_schedule(config)  # as the hook does before it checks
    resolve(config, EPOverlapOptions(delay_wgrad=False, attention_wgrad_window=1, high_priority_comm=False)).checked()


def test_the_checked_config_builds_and_our_rules_accept_its_whole_step_graph():
    from megatron.bridge.training.comm_overlap import CommOverlapConfigError

    args = check.parse_args([])
    config = check.build_config(args, world=2)
    assert (config.moe_token_dispatcher_type, config.moe_flex_dispatcher_backend) == ("flex", "hybridep")
    assert config.moe_expert_rank_capacity_factor == 2.0 and config.use_transformer_engine_op_fuser
    # The fused grouped MLP Megatron-Core builds without the CuTe DSL kernels (experts.py _is_fused_impl_supported).
    from megatron.core.activations import squared_relu

    assert config.activation_func is squared_relu and config.use_fused_weighted_squared_relu
    assert config.moe_grouped_gemm and not config.gated_linear_unit
    assert config.cuda_graph_impl == "full_iteration" and config.cuda_graph_warmup_steps == args.warmup_steps
    assert config.overlap_moe_expert_parallel_comm and config.bf16 and config.num_moe_experts == 4
    _rules(config)
    # The control: without the capacity factor HybridEP sizes its output on the host, and the rule refuses the graph.
    config.moe_expert_rank_capacity_factor = None
    with pytest.raises(CommOverlapConfigError, match="cuda_graph_host_sync"):
        _rules(config)


def test_bitwise_comparison_tells_what_torch_equal_does_not():
    nan = torch.tensor([float("nan")], dtype=torch.bfloat16)
    assert check.same_bits(nan, nan.clone()) and not torch.equal(nan, nan.clone())
    assert not check.same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not check.same_bits(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.bfloat16))


def _arm(args, *, calls=None, graph_after=None, replays=0, iterations=None, grad=1.0) -> "check.ArmResult":
    steps = args.steps
    return check.ArmResult(
        losses=[torch.tensor([[2.0 + s, 10.0]] * args.microbatches) for s in range(steps)],
        grads=[{"w": torch.full((3,), grad, dtype=torch.bfloat16)} for _ in range(steps)],
        weights={"w": torch.ones(3, dtype=torch.bfloat16)},
        calls=calls or [args.microbatches] * steps,
        graph_after=graph_after or [],
        replays_after_capture=replays,
        wrapper_iterations=iterations,
    )


def _graphed(args, **changes) -> "check.ArmResult":
    n, w, m = args.steps, args.warmup_steps, args.microbatches
    fields = dict(
        calls=[m] * (w + 1) + [0] * (n - w - 1),
        graph_after=[False] * w + [True] * (n - w),
        replays=n - w - 1,
        iterations=n,
    )
    return _arm(args, **(fields | changes))


def _verdict(args, eager, graphed, repeat=None) -> tuple[list[str], bool]:
    summary = {
        "rank": 0,
        "eager_losses": [0.2] * args.steps,
        "grad_count": 1,
        "paired_comm": 6,
        "over_budget": False,
        "nonfinite": check._nonfinite(eager),
        "repeat": None if repeat is None else check.compare(repeat, eager),
        "graphed": check.compare(graphed, eager),
        "replay_problems": check.replay_problems(graphed, args),
        "calls": graphed.calls,
        "replays": graphed.replays_after_capture,
        "iterations": graphed.wrapper_iterations,
    }
    return check.report([summary, dict(summary, rank=1)], args, 2, 2.0)


def test_the_verdict_passes_a_replayed_graph_equal_to_eager_and_fails_anything_else():
    args = check.parse_args([])
    eager = _arm(args)
    lines, passed = _verdict(args, eager, _graphed(args), repeat=_arm(args))
    assert passed and lines[-1] == "PASS" and len(lines) == 5  # setup, eager, repeat, graphed, verdict
    assert lines[3].startswith("graphed: FullCudaGraphWrapper warm-up 2: steps 1-2 eager, step 3 captured")
    # a gradient off by one bf16 step
    lines, passed = _verdict(args, eager, _graphed(args, grad=1.0078125))
    assert not passed and "differ from eager's, which is bitwise reproducible" in lines[-1]
    assert "gradient of w" in lines[-2]
    # eager not reproducible either: the failure says the comparison cannot tell
    lines, passed = _verdict(args, eager, _graphed(args, grad=1.0078125), repeat=_arm(args, grad=1.0078125))
    assert not passed and "rerun with --deterministic" in lines[-1]
    # equal numbers, but the Python of a "replayed" step ran: it was not a replay
    lines, passed = _verdict(args, eager, _graphed(args, calls=[args.microbatches] * args.steps))
    assert not passed and "forward_step calls per step" in lines[-1]
    lines, passed = _verdict(args, eager, _graphed(args, replays=0))
    assert not passed and "0 replays after the capture step" in lines[-1]
    nan = _arm(args)
    nan.losses[1][0, 0] = float("nan")
    lines, passed = _verdict(args, nan, _graphed(args))
    assert not passed and "non-finite" in lines[-1]


def _arms_on_cpu(rank: int, world: int) -> dict:
    """The check's eager arm and its graphed arm's warm-up calls (``FullCudaGraphWrapper`` feeding its static buffers;
    no capture without CUDA) on a CPU rank: HybridEP's static-shape stand-in on gloo, Megatron-Core's local spec with
    one local expert (several would read their split on the host, which only the op fuser avoids)."""
    from tests.unit_tests.training.ep_overlap.mcore_cpu import init_megatron, install_cpu_stubs
    from tests.unit_tests.training.ep_overlap.static_hybridep import install_static_hybridep

    install_cpu_stubs()
    install_static_hybridep()
    init_megatron(world)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    sizes = ["--experts-per-rank", "1", "--seq-length", "8", "--hidden-size", "64", "--microbatches", "3"]
    args = check.parse_args([*sizes, "--steps", "3", "--warmup-steps", "1"])
    args.warmup_steps = args.steps  # every call a warm-up call: capture needs CUDA
    config = check.build_config(args, world)
    config.use_cpu_initialization = True

    def build(config, args):
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
        model = GPTModel(config, spec, check.VOCAB, args.seq_length, position_embedding_type="rope")
        return model.bfloat16()

    check.build_model = build  # this forked rank's copy of the module
    initial = {k: v.detach().clone() for k, v in check._state(build(config, args)).items()}
    eager = check.run_arm("eager", args, config, initial, rank, graphed=False)
    graphed = check.run_arm("graphed", args, config, initial, rank, graphed=True)
    return {
        "diff": check.compare(graphed, eager),
        "nonfinite": check._nonfinite(eager),
        "calls": (eager.calls, graphed.calls),
        "paired": eager.paired_comm,
        "graph_after": graphed.graph_after,
        "iterations": graphed.wrapper_iterations,
        "steps": args.steps,
        "losses_differ_by_step": len({tuple(x[:, 0].tolist()) for x in eager.losses}) == args.steps,
    }


def test_the_arms_run_on_cpu_through_the_wrappers_static_buffers_bitwise_equal():
    from ep_overlap_lab.multiprocess import run_local_ranks

    for outcome in run_local_ranks(_arms_on_cpu, 2):
        result = outcome.result
        assert result["diff"] == {"loss_steps": [], "grads": 0, "weights": 0, "first": None}, result["diff"]
        assert result["nonfinite"] is None and result["losses_differ_by_step"]
        assert result["calls"] == ([3] * result["steps"], [3] * result["steps"])
        assert result["paired"] > 0  # our plan ran, its dispatches paired with the other microbatch's compute
        assert result["graph_after"] == [False] * result["steps"] and result["iterations"] == result["steps"]
