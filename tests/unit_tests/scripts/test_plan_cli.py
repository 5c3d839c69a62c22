"""The planner CLI believes nothing it is given: bad flags and files it cannot use get one line each and exit 2."""

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "performance" / "ep_overlap_plan.py"

# The fields of the harness's --json output that the planner reads (one steady step of rank 0's baseline).
SENT = {"bytes_sent": 1e6, "bytes_received": 1e6}
STEP = {
    "comm": [{"op": "dispatch", "layer": 0, **SENT, "start_s": 0.0, "end_s": 0.1}],
    "compute": [{"node": "attn_fwd", "layer": 0, "start_s": 0.0, "end_s": 0.2}],
}
SUMMARY = {
    "config": {
        "model": {"num_layers": 1, "pipeline_model_parallel_size": 1},
        "train": {"warmup_steps": 1, "max_steps": 2, "num_microbatches": 2},
        "link_gbps": 1.0,
    },
    "arms": {"baseline": {"records": {"0": [STEP, STEP]}, "step_times_s": [0.5, 0.5]}, "overlap": {}},
}


def _baseline(*steps: dict) -> dict:
    return {**SUMMARY, "arms": {"baseline": {"records": {"0": list(steps)}, "step_times_s": [0.5] * len(steps)}}}


def _without(*keys: str) -> dict:
    summary = copy.deepcopy(SUMMARY)
    holder = summary
    for key in keys[:-1]:
        holder = holder[key]
    del holder[keys[-1]]
    return summary


def _with(keys: tuple[str, ...], value) -> dict:
    summary = copy.deepcopy(SUMMARY)
    holder = summary
    for key in keys[:-1]:
        holder = holder[key]
    holder[keys[-1]] = value
    return summary


def plan(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=60)


def refused(run: subprocess.CompletedProcess) -> list[str]:
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert run.stdout == ""
    lines = run.stderr.splitlines()
    assert lines and all(line.startswith("error: ") for line in lines), run.stderr
    return lines


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--link_gbps", "-1"], ["--link_gbps=-1.0: give the link's rate", "--link_gbps=-1.0: applies"]),
        (["--model", "mixtral-8x7b", "--ep", "64"], ["--ep=64: must divide --gpus", "--ep=64: must divide the model"]),
        (["--ep", "3"], ["--ep=3: must divide --gpus=16", "--ep=3: must divide the model's 128 experts"]),
        (["--global_batch", "-8"], ["--global_batch=-8: give a positive multiple of --gpus=16"]),
        (["--gpus", "0"], ["--gpus=0: give 1 or more GPUs"]),
        (["--gpus", "8", "--ep", "8", "--global_batch", "12"], ["--global_batch=12: give a positive multiple of"]),
        (["--microbatches", "4", "0"], ["--microbatches=[4, 0]: give microbatch counts of 1 or more"]),
        (["--gpus", "16", "--ep", "1"], ["--ep=1: expert-parallel size 1 moves no tokens between ranks"]),
    ],
)  # fmt: skip
def test_a_layout_the_model_cannot_have_is_refused(argv, expected):
    if "--model" not in argv:
        argv = ["--model", "qwen3-30b-a3b", *argv]
    lines = refused(plan(*argv))
    assert len(lines) == len(expected)
    for line, start in zip(lines, expected):
        assert line.startswith(f"error: {start}")


def test_a_flag_the_source_ignores_is_refused_not_dropped(tmp_path):
    path = tmp_path / "ab.json"
    path.write_text(json.dumps(SUMMARY))
    (line,) = refused(plan("--from_json", str(path), "--gpus", "4"))
    assert (
        line
        == "error: --gpus=4: applies to --model only (--from_json takes the layout from the measured run): drop it"
    )
    (line,) = refused(plan("--model", "qwen3-30b-a3b", "--link_gbps", "100"))
    assert line.startswith("error: --link_gbps=100.0: applies to --from_json")
    (line,) = refused(plan("--from_json", str(path), "--recompute_modules", "moe"))
    assert line == (
        "error: --recompute_modules=['moe']: applies to --model (--from_json: the measured records include it): "
        "drop it"
    )


def test_recompute_is_charged_with_a_published_shape():
    run = plan("--model", "qwen3-30b-a3b", "--recompute_modules", "moe")
    assert run.returncode == 0, run.stderr
    # Its bytes too: the experts keep only their received rows (29.9 GiB keeping everything).
    assert "recomputing moe: at most this): plain 20.9 GiB, overlapped 20.9" in run.stdout
    assert "64 microbatches: plain 41.810 s, overlapped 31.590 s" in run.stdout  # 39.409 s / 29.735 s without


def test_the_minimal_summary_is_accepted(tmp_path):
    path = tmp_path / "ab.json"
    path.write_text(json.dumps(SUMMARY))
    run = plan("--from_json", str(path))
    assert run.returncode == 0, run.stderr
    assert f"costs from {path} (rank 0's baseline records, steps 2..2)" in run.stdout


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "empty; give the file the harness wrote with --json"),
        (json.dumps(SUMMARY)[:-40], "not JSON ("),
        ("[1, 2]", "holds a list, not the harness's --json output"),
        (_without("arms", "baseline"), "has no arms.baseline (an --ab run has it); rerun the harness with --ab"),
        (_without("config", "train", "warmup_steps"), "has no config.train.warmup_steps; rerun the harness with --ab"),
        (_without("arms", "baseline", "records"), "has no arms.baseline.records (an --ab run has it)"),
        ({"status": "stopped by SIGINT", "completed_steps": {}}, "the partial result of a run that stopped by SIGINT"),
        (_baseline(STEP), "no steady baseline step (warmup_steps=1, 1 step record(s))"),
        (_baseline(STEP, {"comm": []}), "arms.baseline.records.0[1] has no compute"),
        (_baseline(STEP, {"comm": [{}], "compute": []}), "arms.baseline.records.0[1].comm[0] lacks one of start_s"),
        (_with(("config", "train", "num_microbatches"), 0), "malformed: config.train.num_microbatches=0 (give"),
        (_with(("config", "train", "num_microbatches"), -3), "malformed: config.train.num_microbatches=-3"),
        (_with(("config", "train", "num_microbatches"), "4"), "malformed: config.train.num_microbatches='4'"),
        (_with(("config", "model", "num_layers"), 1.5), "malformed: config.model.num_layers=1.5"),
        (_with(("config", "link_gbps"), -2), "malformed: config.link_gbps=-2 (give a finite number above 0"),
        (_with(("config", "model", "expert_model_parallel_size"), 1), "expert_model_parallel_size=1 moves no tokens"),
    ],
)  # fmt: skip
def test_a_file_the_planner_cannot_use_gets_one_line_naming_it(tmp_path, content, message):
    path = tmp_path / "ab.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    (line,) = refused(plan("--from_json", str(path)))
    assert line.startswith(f"error: --from_json={path}: ")
    assert message in line


def test_a_missing_file_is_named():
    (line,) = refused(plan("--from_json", "/nonexistent/ab.json"))
    assert line == "error: --from_json=/nonexistent/ab.json: cannot be read (No such file or directory)"


@pytest.mark.parametrize("value", ["nan", "inf", "0"])
def test_a_link_that_is_not_a_finite_positive_rate_is_refused_with_a_measured_run_too(tmp_path, value):
    path = tmp_path / "ab.json"
    path.write_text(json.dumps(SUMMARY))
    (line,) = refused(plan("--from_json", str(path), "--link_gbps", value))
    assert line == f"error: --link_gbps={float(value)!r}: give the link's rate in Gbit/s: a finite number above 0"


def test_a_measured_run_without_communication_is_refused_not_priced(tmp_path):
    path = tmp_path / "ab.json"
    silent = {**STEP, "comm": [{**STEP["comm"][0], "op": "split_exchange"}]}  # no all-to-all moved a byte
    path.write_text(json.dumps(_baseline(silent, silent)))
    (line,) = refused(plan("--from_json", str(path)))
    assert line.startswith("error: no layer moves tokens between ranks")


def _step(comm: dict | None = None, compute: dict | None = None) -> dict:
    return {"comm": [{**STEP["comm"][0], **(comm or {})}], "compute": [{**STEP["compute"][0], **(compute or {})}]}


@pytest.mark.parametrize(
    "step, message",
    [
        (_step(comm={"end_s": -0.5}), "comm[0] has end_s=-0.5 (give finite numbers, 0 or more)"),
        (_step(compute={"start_s": 0.3}), "compute[0] ends (0.2 s) before it starts (0.3 s)"),
        (_step(comm={"bytes_sent": float("nan")}), "comm[0] has bytes_sent=nan"),
        (_step(compute={"end_s": float("inf")}), "compute[0] has end_s=inf"),
        # Probe case: num_layers=1 with records of layer 1 priced half the model.
        (_step(comm={"layer": 1}), "comm[0] is of layer 1, outside config.model.num_layers=1"),
        # Probe case: a zero-duration all-to-all gave "h 0.75" beside a speedup of 1.000x.
        (_step(comm={"end_s": 0.0}), "the baseline's all-to-alls took no time at all, so there is nothing to hide"),
    ],
    ids=["negative", "ends-before-start", "nan-bytes", "inf-time", "layer-outside-the-model", "zero-comm"],
)  # fmt: skip
def test_every_number_of_a_measured_run_is_checked_before_it_is_priced(tmp_path, step, message):
    path = tmp_path / "ab.json"
    path.write_text(json.dumps(_baseline(step, step)))
    (line,) = refused(plan("--from_json", str(path)))
    assert line.startswith(f"error: --from_json={path}: ") and message in line, line


@pytest.mark.parametrize("value", [-0.5, 0.0, float("nan")], ids=["negative", "zero", "nan"])
def test_a_step_time_that_is_not_a_positive_number_is_refused(tmp_path, value):
    path = tmp_path / "ab.json"
    summary = _baseline(STEP, STEP)
    summary["arms"]["baseline"]["step_times_s"] = [0.5, value]
    path.write_text(json.dumps(summary))
    (line,) = refused(plan("--from_json", str(path)))
    assert f"arms.baseline.step_times_s[1]={value!r}" in line


def test_more_layers_than_the_planner_prices_in_bounded_time_are_refused_at_once(tmp_path):
    """Probe case: num_layers=200000 gave no answer within 150 s; now one line, without pricing."""
    path = tmp_path / "ab.json"
    path.write_text(json.dumps(_with(("config", "model", "num_layers"), 200000)))
    (line,) = refused(plan("--from_json", str(path)))
    assert "config.model.num_layers=200000: the planner prices up to 256 layers" in line


def test_the_library_refuses_what_the_cli_refuses():
    from ep_overlap_lab.planner.simulate import MAX_LAYERS, LayerCosts, Link, StepCosts, simulate

    for bad in (0, -1e9, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="bandwidth_Bps"):
            Link(bad)
    with pytest.raises(ValueError, match="latency_s"):
        Link(1e9, latency_s=-1.0)
    costs = StepCosts(layers=(LayerCosts(1.0, 1.0, 1.0, 1.0),) * (MAX_LAYERS + 1), f_tail=0.0, b_head=0.0)
    with pytest.raises(ValueError, match=f"the planner prices up to {MAX_LAYERS} layers"):
        simulate(costs, Link(1e9), 4)


def test_pipelines_are_priced_with_their_stages_memory():
    run = plan("--model", "qwen3-30b-a3b", "--gpus", "32", "--ep", "8", "--pp", "4", "--vpp", "2")
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "pipeline: 4 stages of 8 GPUs, 128 microbatches per step" in out
    assert "PP 4 (1F1B): plain" in out and "PP 4 x VPP 2: plain" in out
    assert "microbatches in flight per stage: plain [4, 3, 2, 1], overlapped [8, 6, 4, 2]" in out


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--model", "qwen3-30b-a3b", "--vpp", "2"], "error: --vpp=2: applies with --pp 2 or more: add --pp"),
        (["--model", "qwen3-30b-a3b", "--gpus", "16", "--ep", "16", "--pp", "2"], "error: --pp=2: with --ep=16 must"),
        (["--model", "qwen3-30b-a3b", "--gpus", "32", "--ep", "8", "--pp", "2", "--vpp", "1"], "error: --vpp=1: give"),
        (["--table", "--pp", "2"], "error: --pp=2: applies to --model and --from_json"),
        (["--model", "deepseek-v3", "--gpus", "512", "--ep", "64", "--pp", "8"], "error: --pp=8 --vpp=None: "),
    ],
)
def test_pipeline_flags_are_refused_one_line_each(argv, line):
    assert any(got.startswith(line) for got in refused(plan(*argv))), line


def test_a_measured_pp1_step_is_priced_on_pipeline_stages(tmp_path):
    layer = {"op": "dispatch", **SENT, "start_s": 0.0, "end_s": 0.1}
    step = {
        "comm": [{**layer, "layer": 0}, {**layer, "layer": 1}],
        "compute": [{"node": "attn_fwd", "layer": j, "start_s": 0.0, "end_s": 0.2} for j in (0, 1)],
    }
    summary = _with(("config", "model", "num_layers"), 2)
    summary["config"]["model"] |= {"hidden_size": 8, "seq_length": 4}
    summary["config"]["train"] |= {"micro_batch_size": 2, "num_microbatches": 4}
    summary["arms"]["baseline"]["records"]["0"] = [step, step]
    path = tmp_path / "ab.json"
    path.write_text(json.dumps(summary))
    run = plan("--from_json", str(path), "--pp", "2")
    assert run.returncode == 0, run.stderr
    assert "pipeline: 2 stages, 4 microbatches per step, the measured costs split over them" in run.stdout
    assert "PP 2 (1F1B): plain" in run.stdout and "overlapped [4, 2]" in run.stdout
    (line,) = refused(plan("--from_json", str(path), "--pp", "2", "--vpp", "2"))  # 1 layer a chunk is not 2
    assert line.startswith("error: --pp=2 --vpp=2: ")


def _recipe_cache(tmp_path, fields: dict) -> dict:
    """An environment whose --recipe reads ``fields`` from a filled cache (no recipe is built)."""
    sys.path.insert(0, str(SCRIPT.parent))
    from utils.plan_recipe import _cache_file

    (tmp_path / _cache_file().name).write_text(json.dumps(fields))
    return {**os.environ, "EP_OVERLAP_PLAN_RECIPES": str(tmp_path)}


def test_a_recipe_is_priced_as_it_is_its_first_speedup_line_with_the_overlap_on(tmp_path):
    from tests.unit_tests.training.ep_overlap.test_planner_recipe import FIELDS, NAME

    env = _recipe_cache(tmp_path, {NAME: {"fields": FIELDS}, NAME.replace("h100", "vr200"): {"fields": FIELDS}})
    started = time.monotonic()
    run = subprocess.run([sys.executable, str(SCRIPT), "--recipe", NAME], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    assert time.monotonic() - started < 10
    first = next(line for line in run.stdout.splitlines() if "speedup" in line)
    assert first.startswith(f"{NAME}: as it is, overlap on (no delayed wgrad): plain 21.720 s, overlapped 18.231 s")
    assert first.endswith("speedup 1.191x")
    assert "16 x H100, 64 microbatches per step, hybridep, 32 SMs" in run.stdout
    run = subprocess.run([sys.executable, str(SCRIPT), "--recipe", NAME.replace("h100", "vr200")], env=env,
                         capture_output=True, text=True)  # fmt: skip
    (line,) = refused(run)
    assert "its name says VR200, which has no hardware profile" in line


def test_layout_flags_are_refused_with_a_recipe():
    lines = refused(plan("--recipe", "perf_recipes.x", "--ep", "4", "--num_sms", "8"))
    assert lines[0] == "error: --ep=4: applies to --model (--recipe takes it from the recipe): drop it"
    assert lines[1] == "error: --num_sms=8: applies with --dispatcher: add it"


def test_the_recipe_checks_entry_prices_a_built_config():
    from types import SimpleNamespace

    from tests.unit_tests.training.ep_overlap.test_planner_recipe import FIELDS, NAME

    sys.path.insert(0, str(SCRIPT.parent))
    from utils.plan_recipe import predicted_gain

    cfg = SimpleNamespace(
        model=SimpleNamespace(**FIELDS["model"]),
        train=SimpleNamespace(global_batch_size=1024, micro_batch_size=1),
        dataset=SimpleNamespace(seq_length=4096),
        comm_overlap=SimpleNamespace(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=False),
    )
    gain = predicted_gain(cfg, NAME)
    assert (round(gain["speedup"], 3), gain["profile"], gain["gpus"], gain["microbatches"]) == (1.191, "H100", 16, 64)
    assert predicted_gain(cfg, NAME.replace("h100", "vr200"))["why"].startswith("its name says VR200")
