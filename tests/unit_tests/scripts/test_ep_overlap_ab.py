"""The perf harness: flags and overrides (with the upstream gotchas fixed), dry-run, errors, JSON and an A/B smoke."""

import json
import os
import shutil
import signal
import subprocess
import sys

import ep_overlap_ab
import ep_overlap_plan
import pytest
import torch
from argument_parser import parse_cli_args
from utils import ab_run, checks, harness_config, netns
from utils.arms import arm_order, build_mcore_model
from utils.checks import run_problems
from utils.overrides import (
    _set_delay_wgrad_overrides,
    _set_moe_a2a_overlap_overrides,
    apply_flag_overrides,
    apply_overrides,
    parse_value,
)
from utils.recipe import small_moe_recipe
from utils.stats import describe_matched, matched_ab

from ep_overlap_lab.multiprocess import run_local_ranks

TINY = [
    "--num_layers", "2", "--hidden_size", "32", "--num_attention_heads", "2", "--ffn_hidden_size", "64",
    "--moe_ffn_hidden_size", "32", "--num_moe_experts", "4", "--moe_router_topk", "2", "--seq_length", "16",
    "--num_microbatches", "3", "-ms", "3",
]  # fmt: skip


def recipe_from(argv):
    args = parse_cli_args(argv)
    return harness_config.build_recipe(args)


@pytest.mark.parametrize(
    "text, value",
    [("true", True), ("False", False), ("none", None), ("null", None), ("4", 4), ("0.5", 0.5), ("[1, 0]", [1, 0]),
     ("alltoall", "alltoall")],
)  # fmt: skip
def test_parse_value(text, value):
    assert parse_value(text) == value


def test_moe_a2a_overlap_true_enables_plain_overlap_only():
    recipe = recipe_from(["--moe_a2a_overlap", "true"])
    assert recipe.comm_overlap.overlap_moe_expert_parallel_comm is True
    assert recipe.comm_overlap.delay_wgrad_compute is None
    assert recipe.model.moe_shared_expert_overlap is False


def test_moe_a2a_overlap_false_turns_off_what_the_recipe_enabled(monkeypatch):
    def recipe_with_everything_on():
        recipe = small_moe_recipe()
        recipe.comm_overlap.overlap_moe_expert_parallel_comm = True
        recipe.comm_overlap.delay_wgrad_compute = True
        return recipe

    monkeypatch.setattr(harness_config, "small_moe_recipe", recipe_with_everything_on)
    recipe = recipe_from(["--moe_a2a_overlap", "false"])
    assert recipe.comm_overlap.overlap_moe_expert_parallel_comm is False
    assert recipe.comm_overlap.delay_wgrad_compute is False


def test_delay_wgrad_has_its_own_flag():
    recipe = recipe_from(["--moe_a2a_overlap", "true", "--delay_wgrad_compute", "true"])
    assert recipe.comm_overlap.delay_wgrad_compute is True


def test_overrides_come_last_and_must_agree_with_the_flags():
    recipe = recipe_from(
        ["--moe_a2a_overlap", "true", "--num_layers", "4", "comm_overlap.overlap_moe_expert_parallel_comm=true",
         "model.num_layers=4", "train.max_steps=2", "model.moe_layer_freq=[1, 0, 1, 0]"]
    )  # fmt: skip
    assert recipe.comm_overlap.overlap_moe_expert_parallel_comm is True
    assert recipe.model.num_layers == 4 and recipe.model.moe_layer_freq == [1, 0, 1, 0]
    assert recipe.train.max_steps == 2
    with pytest.raises(harness_config.ConfigError) as refused:
        recipe_from(["--num_layers", "3", "model.num_layers=4"])
    assert refused.value.problems == [
        "override model.num_layers='4': --num_layers=3 sets model.num_layers=3; give the field one value: drop the "
        "override or the flag"
    ]


def test_none_is_a_fields_own_word_where_it_takes_no_none():
    recipe = small_moe_recipe()
    recipe.model.cuda_graph_impl = "local"
    recipe.model.virtual_pipeline_model_parallel_size = 2
    overrides = ["model.cuda_graph_impl=none", "model.virtual_pipeline_model_parallel_size=None"]
    assert apply_overrides(recipe, overrides) == []
    assert recipe.model.cuda_graph_impl == "none"  # a string field: its value "none" (was refused as None)
    assert recipe.model.virtual_pipeline_model_parallel_size is None  # an optional field: None, as Bridge reads it


@pytest.mark.parametrize(
    "override, message",
    [("model.no_such_field=1", "has no field 'no_such_field'"), ("nosection.x=1", "has no section 'nosection'"),
     ("model.num_layers", "not of the form section.field=value")],
)  # fmt: skip
def test_bad_overrides(override, message):
    (problem,) = apply_overrides(small_moe_recipe(), [override])
    assert message in problem


def test_every_bad_override_is_listed_with_field_type_and_value_and_the_good_ones_apply():
    recipe = small_moe_recipe()
    problems = apply_overrides(
        recipe,
        ["model.hidden_size=abc", "comm_overlap.overlap_moe_expert_parallel_comm=maybe", "train.max_steps=2.5",
         "model.num_layers=4", "model.recompute_modules=[core_attn]"],
    )  # fmt: skip
    assert problems == [
        "override model.hidden_size='abc': expected int, got 'abc'",
        "override comm_overlap.overlap_moe_expert_parallel_comm='maybe': expected bool or null, got 'maybe'",
        "override train.max_steps='2.5': expected int, got 2.5",
    ]
    assert recipe.model.num_layers == 4 and recipe.model.recompute_modules == ["core_attn"]


def test_flags_map_onto_the_model():
    recipe = small_moe_recipe()
    apply_flag_overrides(recipe, parse_cli_args(TINY + ["--precision", "bf16", "--expert_model_parallel_size", "4"]))
    assert (recipe.model.hidden_size, recipe.model.bf16, recipe.model.expert_model_parallel_size) == (32, True, 4)
    assert recipe.train.num_microbatches == 3 and recipe.train.max_steps == 3


@pytest.mark.parametrize("backend", ["deepep", "hybridep"])
def test_flex_backend_is_refused_by_the_reference_model(capsys, backend):
    assert ep_overlap_ab.main(TINY + ["--moe_flex_dispatcher_backend", backend, "-d"]) == 2
    assert "the reference model runs the alltoall dispatcher only; use --model_impl mcore" in capsys.readouterr().err


def test_flex_backend_on_megatron_core_needs_its_package(capsys):
    # Megatron-Core's flex dispatcher runs under our schedule (tests' fake_deepep on CPU); the harness needs the real
    # backend. Here (no deep_ep, no CUDA) both reasons come as one line each, before any rank starts.
    flags = ["--model_impl", "mcore", "--moe_flex_dispatcher_backend", "deepep", "--ab", "--predict", "-d"]
    assert ep_overlap_ab.main(TINY + flags) == 2
    err = capsys.readouterr().err
    assert "--predict: the planner prices each all-to-all by the bytes it moves" in err
    assert "--moe_flex_dispatcher_backend='deepep': its package deep_ep is not installed here" in err
    assert "--model_impl=mcore runs Megatron-Core layers, which need CUDA" in err


def test_upstream_named_overlap_helper_fixes_its_gotchas():
    recipe = small_moe_recipe()
    recipe.comm_overlap.overlap_moe_expert_parallel_comm = recipe.comm_overlap.delay_wgrad_compute = True
    _set_moe_a2a_overlap_overrides(recipe, False)  # upstream left both on
    assert (recipe.comm_overlap.overlap_moe_expert_parallel_comm, recipe.comm_overlap.delay_wgrad_compute) == (
        False,
        False,
    )
    _set_moe_a2a_overlap_overrides(recipe, True)  # upstream turned delayed wgrad on too
    assert (recipe.comm_overlap.overlap_moe_expert_parallel_comm, recipe.comm_overlap.delay_wgrad_compute) == (
        True,
        False,
    )
    assert recipe.model.moe_shared_expert_overlap is False
    _set_delay_wgrad_overrides(recipe, True)
    assert recipe.comm_overlap.delay_wgrad_compute is True


def test_dryrun_prints_resolved_config(capsys):
    assert ep_overlap_ab.main(TINY + ["--ab", "--delay_wgrad_compute", "true", "-d"]) == 0
    out = capsys.readouterr().out
    assert "model.hidden_size = 32" in out
    assert "arm baseline: overlap_moe_expert_parallel_comm=False, delay_wgrad_compute=False" in out
    assert "arm overlap: overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True" in out


def test_config_errors_are_the_rules_errors_without_traceback(capsys):
    bad = ["model.moe_shared_expert_overlap=true"]
    code = ep_overlap_ab.main(TINY + ["--ab", "--expert_model_parallel_size", "1", "-d", *bad])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 2 and all(line.startswith("error: overlap arm: [") for line in lines)
    assert "[no_shared_expert_overlap] model.moe_shared_expert_overlap=True" in err
    assert "[expert_parallel] model.expert_model_parallel_size=1" in err and "Fix: " in err
    assert "Traceback" not in err


def test_router_settings_the_models_cannot_run_are_one_line_each(capsys):
    code = ep_overlap_ab.main(
        TINY + ["-d", "model.moe_router_score_function=softmax", "model.moe_router_bias_update_rate=-1"]
    )
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: model.moe_router_enable_expert_bias=True: expert bias needs sigmoid scores; set "
        "moe_router_score_function='sigmoid', or moe_router_enable_expert_bias=False",
        "error: model.moe_router_bias_update_rate=-1: the expert-bias update rate must be a positive number; set it "
        "to a positive number, e.g. 1e-3",
    ]
    # The recipe's load balancing can be turned off, which gives the router the harness had before it.
    off = recipe_from(TINY + ["model.moe_router_enable_expert_bias=false", "model.moe_router_score_function=softmax"])
    assert not off.model.moe_router_enable_expert_bias


def test_delay_without_overlap_is_rejected(capsys):
    assert ep_overlap_ab.main(TINY + ["--moe_a2a_overlap", "false", "--delay_wgrad_compute", "true", "-d"]) == 2
    assert "delay_wgrad_needs_overlap" in capsys.readouterr().err


def test_mcore_model_impl_needs_cuda(monkeypatch, capsys):
    monkeypatch.setattr(ab_run.torch.cuda, "is_available", lambda: False)
    assert ep_overlap_ab.main(TINY + ["--ab", "--model_impl", "mcore"]) == 2
    assert "--model_impl=mcore runs Megatron-Core layers, which need CUDA" in capsys.readouterr().err


def _train_the_harness_mcore_model(rank: int, world: int, config) -> dict:
    from datetime import timedelta

    from ep_overlap_lab.engine import EPOverlapEngine
    from megatron.bridge.training.ep_overlap.mcore import chunk_for, mcore_ep_groups

    from ..training.ep_overlap.fake_deepep import dispatcher_names, install_fake_deepep
    from ..training.ep_overlap.mcore_cpu import init_megatron, install_cpu_stubs

    install_cpu_stubs()
    if config.moe_token_dispatcher_type == "flex":
        install_fake_deepep()
    init_megatron(world)
    torch.manual_seed(0)
    model = build_mcore_model(config, "cpu")
    engine = EPOverlapEngine(chunk_for(model), mcore_ep_groups(timedelta(seconds=30)), overlap=True)
    gen = torch.Generator().manual_seed(rank)
    data = [tuple(torch.randint(0, config.vocab_size, (2, 2, config.seq_length), generator=gen)) for _ in range(3)]
    engine.step(data)
    return {
        "untrained": [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum()],
        "dispatchers": dispatcher_names(model),
    }


@pytest.mark.parametrize(
    "flags, dispatcher",
    [
        (["--mtp_num_layers", "1"], "MoEAlltoAllTokenDispatcher"),
        (["--moe_flex_dispatcher_backend", "deepep"], "MoEFlexTokenDispatcher"),  # tests' fake_deepep on CPU
    ],
)
def test_the_harness_builds_a_megatron_core_model_that_trains(flags, dispatcher, monkeypatch):
    # What --model_impl mcore builds on a GPU (with one MTP layer; with the flex dispatcher), here on CPU ranks under
    # the test fixture. fake_deepep stands in for deep_ep, whose presence the harness checks.
    monkeypatch.setitem(checks._FLEX_PACKAGES, "deepep", "torch")
    recipe = recipe_from(TINY + ["--model_impl", "mcore", "--moe_a2a_overlap", "true", *flags])
    for outcome in run_local_ranks(_train_the_harness_mcore_model, 2, (recipe.model,)):
        assert outcome.result["untrained"] == []  # the MTP layer's parameters included
        assert outcome.result["dispatchers"] == {dispatcher}


def test_link_without_root_says_so_and_fails(monkeypatch, capsys):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert ep_overlap_ab.main(TINY + ["--ab", "--link_gbps", "1"]) == 3
    assert "--link_gbps needs root" in capsys.readouterr().err


def test_ab_smoke_on_loopback(tmp_path, capsys):
    json_path, png_path = tmp_path / "ab.json", tmp_path / "timeline.png"
    argv = TINY + ["-ms", "4", "--ab", "--predict", "--json", str(json_path), "--timeline", str(png_path)]
    code = ep_overlap_ab.main(argv)  # 3 steady steps: the fewest that give an interval
    out = capsys.readouterr().out
    assert code == 0
    assert "losses and final parameters bitwise equal: yes" in out
    assert "planner (fed the baseline's records): baseline" in out
    result = json.loads(json_path.read_text())
    held = result["activation_peak_bytes"]  # exact bytes held for backward (engine/saved.py), per arm
    assert held["baseline"] == result["arms"]["baseline"]["activation_peak_bytes"] > 0
    assert held["overlap"] == result["arms"]["overlap"]["activation_peak_bytes"] > 0
    assert held["ratio"] == held["overlap"] / held["baseline"]
    assert f"activations held for backward, peak per rank: overlap {held['ratio']:.2f}x the baseline's" in out
    # The planner's count beside it (exact where routing is balanced: test_saved_activations.py); here routing decides
    # how many rows each rank receives, so only its order of size is checked.
    planned = held["planned_balanced_routing"]
    assert 0.5 < planned["baseline"] / held["baseline"] < 2 and 0.5 < planned["overlap"] / held["overlap"] < 2
    assert "the planner's count with balanced routing" in out
    assert result["config"]["launch_off_host"] == "auto"
    assert result["arms"]["overlap"]["launch_off_host"] is True  # auto: the reference model on CPU
    assert result["arms"]["baseline"]["launch_off_host"] is False
    prediction = result["prediction"]
    assert prediction["baseline_step_s"] > 0 and prediction["overlap_step_s"] > 0
    assert {"warmup", "paired", "cooldown"} <= set(prediction["exposed_comm_s_by_phase"])
    # The planner CLI reads the same JSON.
    assert ep_overlap_plan.main(["--from_json", str(json_path)]) == 0
    assert "best of" in capsys.readouterr().out
    assert result["numerics"]["bitwise_equal"] is True
    for arm in ("baseline", "overlap"):
        data = result["arms"][arm]
        assert len(data["step_times_s"]) == 4 and len(data["losses"]) == 4
        for key in ("median_step_time_s", "comm_s", "exposed_comm_s"):
            assert isinstance(data[key], float) and data[key] >= 0
        waited = data["host_waited_for_core_s"]  # Linux reports it; elsewhere it is None and the table says n/a
        assert (
            (isinstance(waited, float) and 0 <= waited < data["median_step_time_s"])
            if sys.platform == "linux"
            else waited is None
        )
    assert "host waited for a core (s)" in out
    lost = result["h_lost"]  # the split of 1 - h covers the compute-bound steps; on a loaded machine there may be none
    assert ("1 - h, split into shares of T_comm" in out) == (lost is not None)
    if lost is not None:
        assert 1 <= lost["steps"] <= result["steady_steps"]
        assert (lost["waited_for_core"] is not None) == (sys.platform == "linux")
    assert result["arms"]["baseline"]["losses"] == result["arms"]["overlap"]["losses"]
    assert result["arms"]["baseline"]["timeline"]["0"]["compute"], "the baseline arm records its compute too"
    for key in ("speedup", "h"):
        lo, hi = result[key]["ci95"]
        assert lo <= result[key]["median"] <= hi
    for arm in ("baseline", "overlap"):
        lo, hi = result["exposed_comm_s"][arm]["ci95"]
        assert 0 <= lo <= result["exposed_comm_s"][arm]["median"] <= hi
    assert result["speedup"]["verdict"] in ("no measurable difference", "overlap faster", "overlap slower")
    assert png_path.stat().st_size > 10_000


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None, reason="needs root and iproute2"
)


@needs_root
def test_emulated_link_is_removed_after_an_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with netns.EmulatedLink(2, 1.0) as link:
            assert set(link.namespaces) <= set(netns._netns_names())
            raise RuntimeError("boom")
    assert not set(link.namespaces) & set(netns._netns_names())


@needs_root
def test_emulated_link_is_removed_on_ctrl_c():
    code = (
        "import os, signal, sys, time\n"
        f"sys.path.insert(0, {str(ep_overlap_ab.Path(ep_overlap_ab.__file__).parent)!r})\n"
        "from utils.netns import EmulatedLink\n"
        "with EmulatedLink(2, 1.0) as link:\n"
        "    print(' '.join(link.namespaces), flush=True)\n"
        "    time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    names = proc.stdout.readline().split()
    assert names and set(names) <= set(netns._netns_names())
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)
    assert not set(names) & set(netns._netns_names())


@needs_root
def test_stale_namespaces_of_killed_runs_are_removed():
    name = f"{netns.PREFIX}999999-r0"  # no such pid
    subprocess.run(["ip", "netns", "add", name], check=True)
    assert name in netns.remove_stale_namespaces()
    assert name not in netns._netns_names()


def test_ab_under_torchrun_on_cpu(tmp_path):
    # The cluster path: torchrun provides the environment; every process runs both arms, rank 0 reports.
    json_path = tmp_path / "ab.json"
    script = ep_overlap_ab.Path(ep_overlap_ab.__file__)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script), "--ab"]
    cmd += ["--device", "cpu", *TINY, "--json", str(json_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert run.stdout.count("losses and final parameters bitwise equal: yes") == 1  # rank 0 only
    assert json.loads(json_path.read_text())["numerics"]["bitwise_equal"] is True


def _arm(step_times, comm, exposed, waited=None):
    return {"step_times_s": step_times, "comm_s": comm, "exposed_comm_s": exposed, "host_waited_for_core_s": waited}


def test_matched_statistics_pair_steps_and_bound_the_median():
    # Two ranks; a step lasts as long as its slowest rank. Step 0 is warm-up.
    baseline = [_arm([9, 4, 4.2, 4.1, 4.0], [1] * 5, [1] * 5), _arm([9, 4.1, 4.0, 4.0, 4.3], [1] * 5, [1] * 5)]
    overlap = [_arm([9, 3.2, 3.1, 3.3, 3.0], [1] * 5, [0.2] * 5), _arm([9, 3.0, 3.2, 3.1, 3.2], [1] * 5, [0.2] * 5)]
    matched = matched_ab(baseline, overlap, warmup=1)
    ratios = [4.1 / 3.2, 4.2 / 3.2, 4.1 / 3.3, 4.3 / 3.2]
    assert matched["steady_steps"] == 4
    assert matched["speedup"]["median"] == pytest.approx(sorted(ratios)[1] / 2 + sorted(ratios)[2] / 2)
    lo, hi = matched["speedup"]["ci95"]
    assert min(ratios) <= lo <= hi <= max(ratios) and lo > 1
    assert matched["speedup"]["verdict"] == "overlap faster"
    hidden = [(4.1 - 3.2) / 1, (4.2 - 3.2) / 1, (4.1 - 3.3) / 1, (4.3 - 3.2) / 1]
    assert matched["h"]["median"] == pytest.approx(sorted(hidden)[1] / 2 + sorted(hidden)[2] / 2)
    assert matched["exposed_comm_s"]["overlap"] == {"median": 0.2, "ci95": [0.2, 0.2]}


def test_what_h_missed_splits_into_exposed_comm_the_extra_wait_for_a_core_and_the_rest():
    # Compute-bound steps (T_comm 1 s of a 4 s baseline step): overlap could take 3 s and takes 3.2 s. Of the
    # 0.2 s, rank means: 0.1 s is exposed comm and 0.05 s more waiting for a core than in the baseline.
    baseline = [_arm([9, 4, 4, 4], [1] * 4, [1] * 4, [0, 0.1, 0.1, 0.1])] * 2
    overlap = [
        _arm([9, 3.2, 3.2, 3.1], [1] * 4, [0, 0.12, 0.12, 0.12], [0, 0.16, 0.16, 0.16]),
        _arm([9, 3.1, 3.1, 3.2], [1] * 4, [0, 0.08, 0.08, 0.08], [0, 0.14, 0.14, 0.14]),
    ]
    matched = matched_ab(baseline, overlap, warmup=1)
    assert matched["h"]["median"] == pytest.approx(0.8)
    lost = matched["h_lost"]
    assert lost["steps"] == 3
    for part, share in (("exposed_comm", 0.1), ("waited_for_core", 0.05), ("rest", 0.05)):
        assert lost[part]["median"] == pytest.approx(share)
    assert describe_matched(matched, 1.0)[-1] == (
        "1 - h, split into shares of T_comm (median of 3 compute-bound steps): exposed comm 0.10 [95% CI 0.10, "
        "0.10], the host's extra wait for a core 0.05 [95% CI 0.05, 0.05], the rest 0.05 [95% CI 0.05, 0.05]"
    )
    # Where the OS does not report the wait, the rest holds it.
    baseline, overlap = ([{**rank, "host_waited_for_core_s": None} for rank in arm] for arm in (baseline, overlap))
    unmeasured = matched_ab(baseline, overlap, warmup=1)
    assert unmeasured["h_lost"]["waited_for_core"] is None
    assert unmeasured["h_lost"]["rest"]["median"] == pytest.approx(0.1)
    assert "wait for a core" not in describe_matched(unmeasured, 1.0)[-1]
    # A comm-bound run has no such split: its ideal step is T_comm, not T_compute.
    comm_bound = matched_ab([_arm([9, 3, 3], [2] * 3, [2] * 3)], [_arm([9, 2.2, 2.2], [2] * 3, [0.1] * 3)], warmup=1)
    assert comm_bound["h_lost"] is None
    assert not describe_matched(comm_bound, 1.0)[-1].startswith("1 - h")


def test_an_interval_across_one_is_no_measurable_difference():
    same = [_arm([1, 1.0, 1.1, 0.9, 1.0], [0.5] * 5, [0.5] * 5)]
    other = [_arm([1, 1.05, 1.0, 0.95, 1.02], [0.5] * 5, [0.4] * 5)]
    matched = matched_ab(same, other, warmup=1)
    assert matched["speedup"]["verdict"] == "no measurable difference"
    assert describe_matched(matched, 0.5)[0].startswith("speedup: no measurable difference")


def test_planner_cli_on_a_published_shape(capsys):
    assert ep_overlap_plan.main(["--model", "qwen3-30b-a3b", "--gpus", "16", "--ep", "16"]) == 0
    out = capsys.readouterr().out
    assert "64 microbatches: plain" in out and "speedup" in out


def test_arms_alternate_abba():
    assert [arm_order(step, ["baseline", "overlap"]) for step in range(4)] == [
        ["baseline", "overlap"],
        ["overlap", "baseline"],
        ["baseline", "overlap"],
        ["overlap", "baseline"],
    ]


def test_launching_off_the_host_where_it_cannot_apply_is_one_line():
    args = parse_cli_args(TINY + ["--device", "cuda", "--launch_off_host", "true"])
    (problem,) = run_problems(args, world=2, expert_parallel=2, torchrun=False, gpus=2)
    assert problem.startswith("--launch_off_host=true: it applies to the reference model on CPU, not to CUDA;")
    for value in ("false", None):
        flags = ["--launch_off_host", value] if value else []
        args = parse_cli_args(TINY + ["--device", "cuda", *flags])
        assert run_problems(args, world=2, expert_parallel=2, torchrun=False, gpus=2) == []


def test_nccl_needs_a_gpu_per_rank_and_gloo_lifts_that():
    args = parse_cli_args(TINY + ["--device", "cuda", "--nproc_per_node", "2"])
    (problem,) = run_problems(args, world=2, expert_parallel=2, torchrun=False, gpus=1)
    assert "NCCL needs one GPU per rank and this host has 1; use --dist_backend gloo" in problem
    args = parse_cli_args(TINY + ["--device", "cuda", "--nproc_per_node", "2", "--dist_backend", "gloo"])
    assert run_problems(args, world=2, expert_parallel=2, torchrun=False, gpus=1) == []


PIPELINE = ["--pipeline_model_parallel_size", "2", "--virtual_pipeline_model_parallel_size", "2", "--num_layers", "4"]


def test_print_schedule_shows_every_pipeline_rank(capsys):
    assert ep_overlap_ab.main(TINY + PIPELINE + ["--ab", "--nproc_per_node", "4", "--print_schedule", "-d"]) == 0
    out = capsys.readouterr().out
    assert "schedule (overlap on): PP 2 x VPP 2, 3 microbatches" in out
    assert "pipeline rank 0:" in out and "pipeline rank 1:" in out
    assert "F u0=m0 c0" in out and "paired" in out and ">Fm0c1@r1" in out
    assert "F L0 + B L0 1: compute combine_bwd" in out  # the windows of a paired layer step, op by op
    assert "model.pipeline_model_parallel_size = 2" in out


def test_the_plain_1f1b_pipeline_pairs_in_the_harness(capsys):
    argv = TINY + ["--num_layers", "4", "--pipeline_model_parallel_size", "2", "--num_microbatches", "4"]
    assert ep_overlap_ab.main(argv + ["--ab", "--nproc_per_node", "4", "--print_schedule", "-d"]) == 0
    out = capsys.readouterr().out
    assert "schedule (overlap on): PP 2 (1F1B), 4 microbatches" in out
    rank0 = out[out.index("pipeline rank 0:") : out.index("pipeline rank 1:")]
    # 2 (P - r - 1) + 1 = 3 warm-up forwards on the first stage, then a paired step, then the cool-down
    assert [line.split()[1] for line in rank0.splitlines()[1:] if line[:5].strip().isdigit()] == [
        "warmup", "warmup", "warmup", "paired", "cooldown", "cooldown", "cooldown"
    ]  # fmt: skip


@pytest.mark.parametrize(
    "argv, message",
    [
        (PIPELINE[:4] + ["--num_layers", "3"], "--num_layers=3: num_layers=3 cannot be split"),
        (PIPELINE[:4] + ["--num_layers", "2"], "holds 1 layers, not divisible by virtual_pipeline_model_parallel"),
        (PIPELINE + ["--nproc_per_node", "2"], "2 ranks cannot hold expert_model_parallel_size=2 x "),
        (PIPELINE + ["--predict"], "--predict: the planner simulates PP = 1"),
        (["--pipeline_model_parallel_size", "0"], "--pipeline_model_parallel_size=0: must be at least 1"),
    ],
)
def test_pipeline_misconfigurations_are_one_line_each_before_any_rank(argv, message, capsys):
    argv = TINY + ["--ab", "--nproc_per_node", "4", *argv]
    assert ep_overlap_ab.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert all(line.startswith("error: ") for line in err.splitlines())


def test_pipelined_ab_is_bitwise_equal_and_reports_p2p_apart(tmp_path, capsys):
    json_path = tmp_path / "pp.json"
    png_path = tmp_path / "pp.png"
    argv = TINY + PIPELINE + ["--num_microbatches", "4", "--ab", "--nproc_per_node", "4", "--json", str(json_path),
                              "--timeline", str(png_path)]  # fmt: skip
    code = ep_overlap_ab.main(argv)
    out = capsys.readouterr().out
    assert code == 0
    assert "4 ranks, PP 2 x VPP 2, EP 2" in out
    assert png_path.stat().st_size > 10_000  # one steady step per arm, every rank's lanes
    assert "losses and final parameters bitwise equal: yes" in out
    result = json.loads(json_path.read_text())
    by_phase = result["arms"]["overlap"]["exposed_comm_s_by_phase"]
    assert {"warmup", "paired", "cooldown"} <= set(by_phase)
    assert {"p2p", "all-to-all"} <= set(by_phase["paired"])
    assert set(result["arms"]["baseline"]["exposed_comm_s_by_phase"]) == {"plain"}
    # The same losses on every layout's last stage: the pipelined baseline is the model the PP = 1 run trains.
    assert result["config"]["model"]["pipeline_model_parallel_size"] == 2
    assert result["bound"] == 3 / 8  # pipeline rank 0 pairs 3 of its 8 forwards (5 run in warm-up)
    # The planner simulates PP = 1: it refuses a pipelined run's JSON instead of misreading it.
    assert ep_overlap_plan.main(["--from_json", str(json_path)]) == 2
    assert "the planner simulates PP = 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--moe_ep_overlap_chunks", "2"], "train.micro_batch_size=1: chunks split a microbatch along its sequences"),
        (["--moe_ep_overlap_chunks", "4"], "ep_overlap.moe_ep_overlap_chunks=4: moe_ep_overlap_chunks must be 1"),
        (
            ["--moe_ep_overlap_chunks", "2", "--micro_batch_size", "2", "--edge_pairing", "true"],
            "ep_overlap.edge_pairing=True: edge pairing and chunking both pair the step's ends",
        ),
        # (chunks with an aux loss: the rule is for Megatron-Core models, test_moe_overlap_rules; the reference model
        # computes none and refuses the coefficient itself, test_harness_cli)
    ],
)
def test_chunking_it_cannot_serve_is_refused_before_any_rank(argv, message, capsys):
    assert ep_overlap_ab.main(TINY + ["--ab", *argv]) == 2
    err = capsys.readouterr().err
    # The rules table's line, as the engine and the Megatron-Core hook raise it, for the arm it concerns.
    assert message in err and "Fix: " in err and "Traceback" not in err
    assert all(line.startswith("error: overlap arm: [chunks_") for line in err.splitlines())


def test_chunked_ab_reports_the_rounding_difference_it_expects(tmp_path, capsys):
    json_path = tmp_path / "chunks.json"
    argv = TINY + ["--ab", "--predict", "--moe_ep_overlap_chunks", "2", "--micro_batch_size", "2",
                   "--json", str(json_path)]  # fmt: skip
    assert ep_overlap_ab.main(argv) == 0
    out = capsys.readouterr().out
    assert "bitwise equal: no (expected: chunking)" in out and "largest relative loss difference" in out
    result = json.loads(json_path.read_text())
    assert result["numerics"]["expected_bitwise"] is False
    assert result["numerics"]["max_loss_rel_diff"] < 1e-5
    assert result["bound"] == 1.0 and result["config"]["moe_ep_overlap_chunks"] == 2
    assert {"warmup", "paired", "cooldown"} <= set(result["prediction"]["exposed_comm_s_by_phase"])


def test_auto_placement_is_printed_and_recorded(tmp_path, capsys):
    json_path = tmp_path / "auto.json"
    argv = TINY + ["--ab", "--delay_wgrad_compute", "true", "--attention_wgrad_window", "auto",
                   "--json", str(json_path)]  # fmt: skip
    assert ep_overlap_ab.main(argv) == 0
    out = capsys.readouterr().out
    assert "placement: attention wgrad in window " in out and "(auto: the planner predicted window 1 " in out
    assert "losses and final parameters bitwise equal: yes" in out
    result = json.loads(json_path.read_text())
    assert result["config"]["attention_wgrad_window"] == "auto"
    chosen = result["arms"]["overlap"]["attention_wgrad_window"]
    assert chosen in (1, 2) and result["placement"].startswith(f"attention wgrad in window {chosen} (auto")


def test_auto_placement_misuse_is_one_line(capsys):
    with pytest.raises(SystemExit) as exited:
        ep_overlap_ab.main(TINY + ["--ab", "--attention_wgrad_window", "3"])
    assert exited.value.code == 2
    assert "expected 1, 2 or auto, got '3'" in capsys.readouterr().err
    argv = TINY + PIPELINE + ["--ab", "--nproc_per_node", "4", "--attention_wgrad_window", "auto"]
    assert ep_overlap_ab.main(argv) == 2
    err = capsys.readouterr().err
    assert "ep_overlap.attention_wgrad_window=None" in err and "the planner that chooses simulates PP = 1" in err
    assert "Traceback" not in err


def test_recompute_modules_take_megatron_lms_list_and_stop_at_an_override():
    recipe = recipe_from(TINY + ["--recompute_modules", "moe", "layernorm", "model.moe_router_bias_update_rate=0.02"])
    assert recipe.model.recompute_granularity == "selective"
    assert recipe.model.recompute_modules == ["moe", "layernorm"]
    assert recipe.model.moe_router_bias_update_rate == 0.02  # the override after the list applied, not a module


@pytest.mark.parametrize(
    "modules, line",
    [
        (["shared_experts"], "model.recompute_modules=['shared_experts']: the reference MoE GPT recomputes layernorm, "
         "core_attn, moe_act, mlp, moe only; drop the others"),
        (["moe_act"], "--recompute_modules moe_act: Megatron-Core's config accepts it only with moe_grouped_gemm; add "
         "model.moe_grouped_gemm=true"),
    ],
)  # fmt: skip
def test_recompute_the_reference_model_cannot_run_is_one_line(modules, line, capsys):
    assert ep_overlap_ab.main(TINY + ["-d", "--recompute_modules", *modules]) == 2
    assert capsys.readouterr().err.startswith(f"error: {line}")


def test_results_that_cannot_go_to_json_at_the_end_are_kept_beside_the_run(tmp_path, monkeypatch):
    from utils.report import save_json

    gone = tmp_path / "out"
    gone.mkdir()
    target = gone / "ab.json"
    shutil.rmtree(gone)  # the folder went away during the run (as a read-only one refuses the open)
    here = tmp_path / "cwd"
    here.mkdir()
    monkeypatch.chdir(here)
    written, problem = save_json({"speedup": 1.5}, str(target))
    assert problem == f"--json={str(target)!r}: cannot be written now (No such file or directory)"
    assert os.path.dirname(written) == str(here) and json.loads(open(written).read()) == {"speedup": 1.5}
    assert save_json({"speedup": 1.5}, str(here / "fine.json")) == (str(here / "fine.json"), None)


def test_the_console_counts_a_step_when_every_rank_finished_it(capsys):
    progress = ab_run.Progress(max_steps=4, ranks=2)
    report = {"arm": "baseline", "step_time_s": 0.5, "loss": 1.0, "exposed_comm_s": 0.1}
    for step in (1, 2):
        for rank in (1, 0):
            progress.record(rank, {**report, "step": step})
    progress.record(0, {**report, "step": 3})  # rank 1 has not finished step 3
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in printed] == ["  [baseline] step 1/4", "  [baseline] step 2/4"]
    assert progress.describe(4) == "baseline 2/4 on every rank (step 3 on 1 of 2 ranks)"


def test_an_interrupt_once_every_rank_finished_every_step_is_dropped():
    from utils.stopping import signal_handlers, stopping_until

    progress = ab_run.Progress(max_steps=2, ranks=2, arms=["baseline", "overlap"], echo=False)
    with signal_handlers(stopping_until(progress.all_done)):
        for arm in ("baseline", "overlap"):
            progress.record(0, {"arm": arm, "step": 2})
        progress.record(1, {"arm": "baseline", "step": 2})
        with pytest.raises(KeyboardInterrupt):  # rank 1 has a step of the overlap arm left: the run stops
            signal.raise_signal(signal.SIGINT)
        progress.record(1, {"arm": "overlap", "step": 2})
        signal.raise_signal(signal.SIGINT)  # only the results are left to return: dropped
        with pytest.raises(SystemExit):  # SIGTERM still stops
            signal.raise_signal(signal.SIGTERM)


def test_a_profiled_ab_writes_one_trace_per_arm_outside_the_statistics(tmp_path, capsys):
    from utils.trace_overlap import analyze, read_trace

    out = tmp_path / "prof"
    assert (
        ep_overlap_ab.main(TINY + ["--ab", "-ms", "3", "--profile", str(out), "--json", str(tmp_path / "ab.json")])
        == 0
    )
    printed = capsys.readouterr().out
    summary = json.loads((tmp_path / "ab.json").read_text())
    for arm in ("baseline", "overlap"):
        trace = out / f"{arm}.json"
        assert summary["arms"][arm]["profile_trace"] == str(trace) and str(trace) in printed
        assert len(summary["arms"][arm]["step_times_s"]) == 3  # the profiled fourth step is in no statistic
        (step,) = analyze(read_trace(str(trace)))  # the whole path: a 2-rank CPU run's trace through the tool
        assert step.name == "ProfilerStep#4" and step.total.comm_s > 0 and step.total.compute_s > 0
