"""The harness as a user runs it: quiet, bad input refused before any rank starts, signals stop everything."""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "performance" / "ep_overlap_ab.py"
TINY = [
    "--num_layers", "1", "--hidden_size", "32", "--num_attention_heads", "2", "--ffn_hidden_size", "32",
    "--moe_ffn_hidden_size", "32", "--num_moe_experts", "4", "--seq_length", "16", "--num_microbatches", "2",
]  # fmt: skip
FULL = ["--recompute_granularity", "full", "--recompute_method", "uniform", "--recompute_num_layers", "1"]

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None, reason="needs root and iproute2"
)


def harness(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=timeout)


def test_help_answers_without_importing_torch():
    code = (
        "import runpy, sys\n"
        f"sys.argv = [{str(SCRIPT)!r}, '--help']\n"
        "try:\n"
        f"    runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert "no wall-clock limit" in run.stdout and "10 x train.collective_timeout_s" in run.stdout
    assert run.stdout.strip().endswith("torch imported: False")


def test_a_bad_flag_is_one_line_and_status_2():
    run = harness("--num_layers", "x")
    assert run.returncode == 2
    assert run.stderr == "error: argument --num_layers: invalid int value: 'x' (see --help)\n"


@pytest.mark.parametrize("dryrun", [[], ["-d"]])
def test_every_bad_value_is_one_line_before_any_rank_starts(tmp_path, dryrun):
    run = harness(
        *TINY, "--ab", "-ms", "1", "--link_gbps", "nan", "--num_layers", "0", "--timeline", str(tmp_path / "t.jpg"),
        "model.hidden_size=abc", "comm_overlap.overlap_moe_expert_parallel_comm=maybe", *dryrun,
    )  # fmt: skip
    assert run.returncode == 2
    assert run.stderr.splitlines() == [
        "error: override model.hidden_size='abc': expected int, got 'abc'",
        "error: override comm_overlap.overlap_moe_expert_parallel_comm='maybe': expected bool or null, got 'maybe'",
        "error: model.num_layers=0: must be at least 1",
        "error: --max_steps=1: must be at least 2 (train.warmup_steps=1 warm-up step(s) are not measured; one "
        "steady step is needed)",
        "error: --link_gbps=nan: must be a positive number of Gbit/s, e.g. 0.2",
        f"error: --timeline={str(tmp_path / 't.jpg')!r}: use a file ending in one of .png, .pdf, .svg",
    ]
    assert "running arm" not in run.stdout


@pytest.mark.parametrize(
    "argv, lines",
    [
        # The reference model has neither: refused, not silently run without them.
        (
            ["--mtp_num_layers", "1"],
            [
                "error: model.mtp_num_layers=1: the reference MoE GPT has no multi-token prediction layers; drop it, "
                "or run a Megatron-Core model (the harness's --model_impl mcore)"
            ],
        ),
        (
            ['model.hybrid_layer_pattern="*E"'],
            [
                "error: model.hybrid_layer_pattern='*E': the reference MoE GPT is not a hybrid model; drop it, or run "
                "a Megatron-Core HybridModel (the harness's --model_impl mcore)"
            ],
        ),
        (
            ["model.hybrid_layer_pattern=*E"],  # YAML reads *E as an alias
            [
                "error: override 'model.hybrid_layer_pattern=*E': cannot parse the value (found undefined alias); a "
                "value that starts with YAML syntax (* & ! %) needs quotes: model.hybrid_layer_pattern='\"*E\"' in "
                "the shell"
            ],
        ),
        # On this CPU host: every reason a hybrid pattern cannot run, then the one for Megatron-Core models.
        (
            ["--model_impl", "mcore", "--hybrid_layer_pattern", "*X|-/*E/*", "--num_layers", "4"],
            [
                "error: --hybrid_layer_pattern='*X|-/*E/*': unknown layer symbol(s) 'X'; use * attention, + MLA, "
                "D DSA, - MLP, M Mamba, G GDN, E MoE; / before an MTP depth",
                "error: --hybrid_layer_pattern='*X|-/*E/*': pipeline segments ('|'): the harness builds Megatron-Core "
                "models at PP 1; drop '|'",
                "error: --hybrid_layer_pattern='*X|-/*E/*': no MoE layer (E) before '/', so there is no all-to-all to "
                "overlap; add one",
                "error: --hybrid_layer_pattern='*X|-/*E/*': every MTP depth after '/' needs the same, non-empty "
                "pattern",
                "error: --num_layers=4: the pattern has 3 layers before '/'; drop the flag",
            ],
        ),
    ],
)
def test_a_model_feature_the_chosen_model_does_not_have_is_refused(argv, lines):
    run = harness(*TINY[2:], "-d", *argv)
    assert run.returncode == 2
    assert run.stderr.splitlines()[: len(lines)] == lines


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only host's answer")
def test_a_megatron_core_hybrid_model_on_a_cpu_host_says_what_it_cannot_run():
    run = harness(*TINY[2:], "-d", "--model_impl", "mcore", "--hybrid_layer_pattern", "*E*E/*E")
    assert run.returncode == 2
    cuda = "error: --model_impl=mcore runs Megatron-Core layers, which need CUDA"
    assert run.stderr.splitlines()[-1].startswith(cuda)
    if importlib.util.find_spec("transformer_engine") is None:
        assert run.stderr.splitlines()[0].startswith(
            "error: --hybrid_layer_pattern='*E*E/*E': Megatron-Core ships HybridModel's layers as a Transformer "
            "Engine spec only"
        )


def test_predict_without_an_ab_is_refused():
    run = harness(*TINY, "-d", "--predict")
    assert run.returncode == 2
    assert run.stderr == "error: --predict compares the planner with a measured A/B: add --ab\n"


def test_unwritable_output_is_refused_up_front():
    run = harness(*TINY, "-d", "--json", "/proc/no/such/dir/ab.json")
    assert run.returncode == 2
    assert run.stderr.startswith("error: --json='/proc/no/such/dir/ab.json': cannot create its folder")


def test_a_profile_folder_whose_overlap_trace_name_is_taken_by_a_folder_is_refused_up_front(tmp_path):
    """Probe case: with DIR/overlap.json a non-empty folder the pre-run check looked at baseline.json only, and the run
    exited 0 naming a trace torch had written to overlap.json.tmp."""
    (tmp_path / "prof" / "overlap.json").mkdir(parents=True)
    (tmp_path / "prof" / "overlap.json" / "x").write_text("")
    run = harness(*TINY, "-d", "--ab", "--profile", str(tmp_path / "prof"))
    assert run.returncode == 2
    assert run.stderr == f"error: --profile='{tmp_path}/prof/overlap.json': is a folder; give a file name\n"


def test_both_spellings_of_the_overlap_flag_follow_one_rule():
    # fp32 is fine for this project's schedule, whether overlap is asked for on the model or through the flag.
    for spelling in (["model.overlap_moe_expert_parallel_comm=true"], ["--moe_a2a_overlap", "true"]):
        run = harness(*TINY, "-d", *spelling)
        assert run.returncode == 0, run.stderr
        assert "arm run: overlap_moe_expert_parallel_comm=True" in run.stdout


def test_third_party_warnings_only_with_verbose():
    quiet, loud = harness(*TINY, "-d"), harness(*TINY, "-d", "-v")
    assert quiet.returncode == loud.returncode == 0
    assert quiet.stderr == ""
    assert "Transformer Engine and Apex are not installed" in loud.stderr


def test_a_real_ab_prints_nothing_to_learn_to_ignore(tmp_path):
    run = harness(*TINY, "--ab", "-ms", "2", "--json", str(tmp_path / "ab.json"))
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""
    assert "losses and final parameters bitwise equal: yes" in run.stdout


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError):
                continue
    return found


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False  # gone; a zombie ("Z") has exited too and only waits to be reaped


def _start_long_run(tmp_path: Path, *extra: str, seen: list | None = None) -> tuple[subprocess.Popen, list[int]]:
    """A run far too long to finish, started and waited for until its third step is done (the lines it printed
    until then go to ``seen``)."""
    cmd = [sys.executable, str(SCRIPT), *TINY, "--ab", "-ms", "100000", "--json", str(tmp_path / "ab.json"), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if seen is not None:
            seen.append(line)
        if "step 3/100000" in line:
            break
    return proc, _children(proc.pid)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_stops_every_rank_within_5s_and_keeps_finished_steps(tmp_path, sig, code):
    proc, ranks = _start_long_run(tmp_path)
    assert ranks, "no rank processes found"
    start = time.monotonic()
    proc.send_signal(sig)
    err = proc.communicate(timeout=30)[1]
    assert time.monotonic() - start < 5
    assert proc.returncode == code
    (line,) = err.splitlines()
    assert line.startswith(f"stopped by {sig.name} while running arms baseline and overlap; every rank stopped; ")
    assert f"partial results written to {tmp_path / 'ab.json'}" in line
    assert not [pid for pid in ranks if _alive(pid)]
    partial = json.loads((tmp_path / "ab.json").read_text())
    assert partial["status"] == f"stopped by {sig.name}"
    steps = partial["completed_steps"]["baseline"]
    assert steps[0]["step"] == 1 and steps[0]["ranks"] == 2  # later steps may still have been in flight


@needs_root
def test_namespaces_go_with_sigterm_and_a_killed_runs_are_removed_and_reported(tmp_path):
    def namespaces(pid: int) -> list[str]:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return [line.split()[0] for line in out.splitlines() if line.startswith(f"epov{pid}-")]

    proc, _ = _start_long_run(tmp_path, "--link_gbps", "1")
    assert namespaces(proc.pid)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert namespaces(proc.pid) == []

    proc, ranks = _start_long_run(tmp_path, "--link_gbps", "1")
    leaked = namespaces(proc.pid)
    proc.kill()  # SIGKILL: nothing of the parent runs; its ranks die with it
    proc.communicate(timeout=30)
    time.sleep(0.5)
    assert not [pid for pid in ranks if _alive(pid)]
    assert namespaces(proc.pid) == leaked  # only the next run can clean up
    run = harness(*TINY, "-ms", "2", "--link_gbps", "1")
    assert run.returncode == 0, run.stderr
    assert f"note: removed {len(leaked)} network namespace(s) left by a run that was killed" in run.stdout
    assert namespaces(proc.pid) == []


def test_an_output_under_proc_is_refused_up_front_not_after_the_run():
    run = harness(*TINY, "-d", "--json", "/proc/ab.json")
    assert run.returncode == 2
    assert run.stderr.startswith("error: --json='/proc/ab.json': cannot be written (")


def test_the_partial_json_holds_every_step_the_console_printed(tmp_path):
    lines = []
    proc, _ = _start_long_run(tmp_path, seen=lines)
    proc.send_signal(signal.SIGINT)
    lines += proc.communicate(timeout=30)[0].splitlines()
    printed = {
        (line.split("]")[0].split("[")[1], int(line.split("step ")[1].split("/")[0]))
        for line in lines
        if line.startswith("  [")
    }
    assert {("baseline", 3), ("overlap", 3)} & printed
    partial = json.loads((tmp_path / "ab.json").read_text())
    saved = {(arm, step["step"]) for arm, steps in partial["completed_steps"].items() for step in steps}
    assert printed and printed <= saved


def test_an_interrupt_after_the_last_step_still_writes_the_full_report(tmp_path):
    json_path = tmp_path / "ab.json"
    cmd = [sys.executable, str(SCRIPT), *TINY, "--ab", "-ms", "3", "--json", str(json_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    last = 0
    for line in proc.stdout:
        last += "step 3/3" in line
        if last == 2:  # both arms' last step is done; the ranks have only their results left to return
            proc.send_signal(signal.SIGINT)
            break
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "speedup" in out and "bitwise equal" in out
    assert "speedup" in json.loads(json_path.read_text())


def _catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for ``signum`` (the SigCgt mask of /proc/PID/status)."""
    status = (Path("/proc") / str(pid) / "status").read_text()
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(mask >> (signum - 1) & 1)


def test_a_signal_during_the_imports_stops_a_background_run():
    def like_a_background_job():  # a shell starts a background job with SIGINT ignored
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    proc = subprocess.Popen([sys.executable, str(SCRIPT), *TINY, "--ab", "-d"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=like_a_background_job)  # fmt: skip
    while not _catches(proc.pid, signal.SIGINT):  # its handler is set; torch is still being imported
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert err == "stopped by SIGINT while starting up; no rank had started\n"


def test_no_interval_from_fewer_than_three_steady_steps():
    run = harness(*TINY, "--ab", "-ms", "3")  # 2 steady steps
    assert run.returncode == 0, run.stderr
    assert "speedup (matched per-step ratio, median of 2 steps): " in run.stdout
    assert "(too few steps for an interval)" in run.stdout and "95% CI" not in run.stdout


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--ab", "--moe_a2a_overlap", "false"], "error: --moe_a2a_overlap=False: with --ab the baseline arm runs"),
        (["--edge_pairing", "true"], "error: --edge_pairing=true: it pairs the overlapped schedule's warm-up"),
        (
            ["--nproc_per_node", "4", "--moe_a2a_overlap", "true", "--edge_pairing", "true",
             "--pipeline_model_parallel_size", "2", "--virtual_pipeline_model_parallel_size", "2",
             "--num_layers", "4"],
            "error: --edge_pairing=true: it applies at PP 1",
        ),
        (["--moe_a2a_overlap", "true", "--attention_wgrad_window", "2"], "error: --attention_wgrad_window=2: it"),
        (["--ab", "--attention_wgrad_window", "auto"], "error: --attention_wgrad_window=auto: it places"),
        (["--ab", "model.recompute_modules=[moe]"], "error: model.recompute_modules=['moe']: with recompute_granular"),
        (FULL[:-1] + ["0"], "error: model.recompute_num_layers=0: full recompute needs the layers per segment"),
        (FULL + ["--recompute_modules", "moe"], "error: --recompute_modules moe: it lists selective recompute's"),
        (FULL[2:4], "error: model.recompute_method='uniform': a recompute method chooses the layers of full"),
        (["model.moe_layer_freq=[0,0]"], "error: model.moe_layer_freq=[0, 0]: no MoE layer, so there is no all-to"),
        (["model.moe_layer_freq=[1,1,1]"], "error: model.moe_layer_freq=[1, 1, 1]: has 3 entries and num_layers=2"),
        (["model.moe_layer_freq=[2,0]"], "error: model.moe_layer_freq=[2, 0]: entries must be 0 (dense) or 1 (MoE)"),
        (["model.add_bias_linear=true"], "error: model.add_bias_linear=True: the EP-overlap models run bias-free"),
        # Model fields the reference model does not compute with are refused by name, not run as the default.
        (["model.moe_expert_capacity_factor=1.0"], "error: model.moe_expert_capacity_factor=1.0: the reference MoE"),
        (["model.moe_shared_expert_gate=true"], "error: model.moe_shared_expert_gate=True: the reference MoE GPT"),
        (
            ["model.moe_router_load_balancing_type=global_aux_loss", "model.moe_aux_loss_coeff=0.01"],
            "error: model.moe_router_load_balancing_type='global_aux_loss': the reference MoE GPT computes the",
        ),
        (
            ["model.moe_router_load_balancing_type=none", "model.moe_aux_loss_coeff=0.01"],
            "error: model.moe_aux_loss_coeff=0.01: moe_router_load_balancing_type='none' computes no load-balancing",
        ),
    ],
)  # fmt: skip
def test_a_flag_or_field_that_cannot_act_is_refused_before_any_rank(argv, line):
    run = harness(*TINY[2:], "-d", *argv)
    assert run.returncode == 2, run.stdout
    assert [entry[: len(line)] for entry in run.stderr.splitlines()] == [line]


PIPELINE_2 = ["--nproc_per_node", "4", "--pipeline_model_parallel_size", "2", "--num_layers", "4"]

# One use of each flag in the harness's table of what flags set (overrides.FLAG_SETTERS), with the flags it needs
# beside it: accepted on its own, or (a model the reference model has not) refused for its own reason only.
FLAG_SAMPLES = {
    "ab": [["--ab"]],
    "moe_a2a_overlap": [["--moe_a2a_overlap", "true"], ["--moe_a2a_overlap", "false"]],
    "delay_wgrad_compute": [["--moe_a2a_overlap", "true", "--delay_wgrad_compute", "true"],
                            ["--delay_wgrad_compute", "false"]],
    "cuda_graph_impl": [["--cuda_graph_impl", "none"]],
    "precision": [["--precision", "bf16"]],
    "hybrid_layer_pattern": [["--hybrid_layer_pattern", "*E"]],
    "mtp_num_layers": [["--mtp_num_layers", "0"]],
    "recompute_modules": [["--recompute_modules", "moe"]],
    "recompute_granularity": [FULL],
    "recompute_method": [FULL],
    "recompute_num_layers": [FULL, ["-rl", "1"]],
    **{TINY[i][2:]: [TINY[i : i + 2]] for i in range(0, len(TINY), 2)},
    "moe_router_topk": [["--moe_router_topk", "1"]],
    "expert_model_parallel_size": [["--expert_model_parallel_size", "2"]],
    "pipeline_model_parallel_size": [PIPELINE_2],
    "virtual_pipeline_model_parallel_size": [PIPELINE_2 + ["--virtual_pipeline_model_parallel_size", "2"]],
    "max_steps": [["-ms", "3"]],
    "micro_batch_size": [["--micro_batch_size", "1"]],
    "seed": [["--seed", "7"]],
    "moe_flex_dispatcher_backend": [["--moe_flex_dispatcher_backend", "deepep"]],
}  # fmt: skip


def _differing(field, value):
    """A value the harness's type check accepts for ``field`` ("section.name") and that is not ``value``."""
    import typing

    from utils.overrides import _field_types, _matches
    from utils.recipe import small_moe_recipe

    section, name = field.split(".")
    hint = _field_types(type(getattr(small_moe_recipe(), section)))[name]
    words = [arg for arg in typing.get_args(hint) if isinstance(arg, str)]
    words += [arg for union in typing.get_args(hint) for arg in typing.get_args(union) if isinstance(arg, str)]
    if isinstance(value, bool):
        candidates = [not value]
    elif isinstance(value, int | float):
        candidates = [value + 1]
    elif isinstance(value, list):
        candidates = [value[:-1], [*value, "core_attn"]]
    else:
        candidates = [*words, value + "_other"]
    return next(other for other in candidates if other != value and _matches(other, hint))


def _dry_run(capsys, argv):
    import ep_overlap_ab

    code = ep_overlap_ab.main([*argv, "-d"])  # in this process: the first call's import warnings are not errors
    return code, [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]


def test_every_flag_in_the_table_has_a_sample():
    from utils.overrides import FLAG_SETTERS

    assert set(FLAG_SETTERS) == set(FLAG_SAMPLES)


@pytest.mark.parametrize("flag", sorted(FLAG_SAMPLES))
def test_an_override_that_contradicts_a_flag_is_refused_in_every_spelling(capsys, flag):
    """Issue 54: --moe_a2a_overlap false with comm_overlap.overlap_moe_expert_parallel_comm=true ran overlapped,
    while the model. spelling of the same contradiction was refused. Each field a flag sets, in each spelling that
    reaches it (both from the harness's own tables), is now refused with one line when it disagrees and accepted
    when it agrees."""
    from argument_parser import parse_cli_args
    from utils.overrides import apply_flag_overrides, same_field
    from utils.recipe import small_moe_recipe

    walked = 0
    for sample in FLAG_SAMPLES[flag]:
        argv = [*TINY, *sample]
        alone = _dry_run(capsys, argv)
        set_by = apply_flag_overrides(small_moe_recipe(), parse_cli_args(argv))
        fields = {field: value for field, (given, value) in set_by.items() if given.startswith(f"--{flag}=")}
        for field, value in fields.items():
            for spelling in same_field(field):
                walked += 1
                agreeing = _dry_run(capsys, [*argv, f"{spelling}={json.dumps(value)}"])
                assert agreeing == alone, (spelling, value)
                other = _differing(field, value)
                code, lines = _dry_run(capsys, [*argv, f"{spelling}={json.dumps(other)}"])
                assert code == 2, (spelling, other)
                assert lines[1:] == alone[1], (spelling, other, lines)
                assert lines[0].startswith(f"error: override {spelling}={json.dumps(other)!r}: --{flag}=")
                assert f" sets {field}={value!r}" in lines[0] and "drop the override or the flag" in lines[0]
    assert walked


def test_the_issues_contradiction_is_one_line_and_status_2_before_any_rank():
    for spelling in ("comm_overlap", "model"):
        run = harness(*TINY, "--moe_a2a_overlap", "false", f"{spelling}.overlap_moe_expert_parallel_comm=true")
        assert run.returncode == 2
        assert run.stderr.splitlines() == [
            f"error: override {spelling}.overlap_moe_expert_parallel_comm='true': --moe_a2a_overlap=False sets "
            "comm_overlap.overlap_moe_expert_parallel_comm=False"
            + (", the same field" if spelling == "model" else "")
            + "; give the field one value: drop the override or the flag"
        ]
        assert "running arm" not in run.stdout


def test_virtual_stages_without_a_pipeline_are_refused_before_any_rank(capsys):
    """Issue 54: --virtual_pipeline_model_parallel_size 2 at PP 1 passed the dry run; its ranks then failed."""
    for vpp in ("--virtual_pipeline_model_parallel_size 2", "model.virtual_pipeline_model_parallel_size=2"):
        assert _dry_run(capsys, [*TINY[2:], *vpp.split()]) == (
            2,
            [
                "error: --virtual_pipeline_model_parallel_size=2: virtual stages split each pipeline stage into "
                "chunks, and pipeline_model_parallel_size=1 is no pipeline; add --pipeline_model_parallel_size 2 (or "
                "more), or drop it"
            ],
        )
    assert _dry_run(capsys, [*TINY, *PIPELINE_2, "--virtual_pipeline_model_parallel_size", "2"])[0] == 0


def test_full_recompute_flags_reach_the_config_and_the_printed_schedule():
    run = harness(*TINY[2:], "-d", "--ab", "-rl", "1")  # upstream's -rl alone: full recompute of the first layer
    assert run.returncode == 0, run.stderr
    for line in ("model.recompute_granularity = 'full'", "model.recompute_method = 'block'",
                 "model.recompute_num_layers = 1"):  # fmt: skip
        assert line in run.stdout, run.stdout
    run = harness(*TINY, "--ab", "--print_schedule", *FULL)
    assert run.returncode == 0, run.stderr
    assert "compute replay_pre_dispatch u0 L0; launch replay_dispatch u0 L0" in run.stdout, run.stdout


def test_the_flags_that_act_are_accepted_and_shown_in_the_dry_run():
    run = harness(*TINY[2:], "-d", "--ab", "--delay_wgrad_compute", "true", "--attention_wgrad_window", "2",
                  "--edge_pairing", "true")  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert (
        "arm overlap: overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True, attention_wgrad_window=2, "
        "edge_pairing=True" in run.stdout
    )
