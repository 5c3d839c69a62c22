"""The upstream-CI routine's own logic (tools/upstream_ci.py): which tests it picks, how it reads their outcomes and
reports regressions and the patch's own tests, and the Transformer Engine stand-in. The routine itself needs
upstream's sources and is not part of ``make test``."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import upstream_ci  # noqa: E402


def test_it_selects_the_test_files_that_import_what_the_patch_touches(tmp_path):
    tests = tmp_path / "tests" / "unit_tests"
    files = {
        "training/test_a.py": "from megatron.bridge.training.comm_overlap import CommOverlapConfig\n",
        "training/test_b.py": "from megatron.bridge.training import config\n",
        "recipes/test_c.py": "import megatron.bridge.recipes.moonlight as m\n",
        "models/test_d.py": "from megatron.bridge.models import gpt_provider\n",
        "training/helper.py": "from megatron.bridge.training.comm_overlap import x\n",
        "training/test_e.py": "from megatron.bridge.training.train import train\n",  # files the stored hunks change
        "models/test_f.py": "import megatron.bridge.models.qwen_vl.qwen3_vl_step as step\n",
        "training/test_g.py": "from megatron.bridge.training import state\n",
    }
    for name, text in files.items():
        (tests / name).parent.mkdir(parents=True, exist_ok=True)
        (tests / name).write_text(text)
    assert upstream_ci.select_tests(tmp_path) == [
        "models/test_f.py", "recipes/test_c.py", "training/test_a.py", "training/test_b.py", "training/test_e.py"
    ]  # fmt: skip


def _junit(path: Path, cases: dict[str, str]) -> Path:
    body = {"passed": "", "failed": "<failure message='x'/>", "skipped": "<skipped/>"}
    path.write_text(
        "<testsuites><testsuite>"
        + "".join(f'<testcase classname="t" name="{name}">{body[state]}</testcase>' for name, state in cases.items())
        + "</testsuite></testsuites>"
    )
    return path


def test_outcomes_and_the_regression_report(tmp_path, capsys):
    before = upstream_ci.outcomes(_junit(tmp_path / "a.xml", {"x": "passed", "y": "passed", "z": "failed"}))
    after = upstream_ci.outcomes(_junit(tmp_path / "b.xml", {"x": "passed", "y": "failed", "z": "passed"}))
    assert before == {"t::x": "passed", "t::y": "passed", "t::z": "failed"}
    assert upstream_ci.report({"as-is": before, "patched": after}, files=1) == 1
    out = capsys.readouterr().out
    assert "as-is: 1 files, 2 passed, 1 failed, 0 skipped" in out
    assert "regressions (pass as it is, not with the patch): 1\n  t::y (failed)" in out
    assert "pass only with the patch: 1\n  t::z" in out
    assert upstream_ci.report({"as-is": before, "patched": before}, files=1) == 0


def test_the_patchs_own_tests_and_their_report(tmp_path, capsys):
    own = upstream_ci.own_tests()
    assert "training/ep_overlap/test_mcore_hook.py" in own and "training/ep_overlap/test_comm_overlap_rules.py" in own
    assert "training/ep_overlap/test_planner.py" not in own  # the lab's: not in the patch
    assert "training/ep_overlap/test_layout.py" not in own  # this repository's layout
    assert own[-2:] == ["training/test_gpt_step_mtp_loss_mask.py", "training/test_gpt_step_packed_schedule_plan.py"]
    states = upstream_ci.outcomes(_junit(tmp_path / "own.xml", {"x": "passed", "y": "skipped", "z": "failed"}))
    assert upstream_ci.report_own(states) == 1
    out = capsys.readouterr().out
    assert f"the patch's own tests, patched: {len(own)} files, 1 passed, 1 failed, 1 skipped" in out
    assert "  failed: t::z" in out
    assert upstream_ci.report_own({"t::x": "passed", "t::y": "skipped"}) == 0


def test_transformer_engine_imports_for_megatron_bridge_only(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(upstream_ci.TE_STAND_IN)
    package = tmp_path / "megatron" / "bridge"
    package.mkdir(parents=True)
    (package / "layers.py").write_text("import transformer_engine.pytorch as te\nBASE = te.ops.Sequential\n")
    code = textwrap.dedent("""
        import importlib.util
        print(importlib.util.find_spec("transformer_engine") is None)  # others find nothing
        try:
            import transformer_engine
        except ModuleNotFoundError:
            print("absent")
        import megatron.bridge.layers as layers
        try:
            layers.BASE()
        except ImportError as error:
            print("stand-in:", error)
    """)
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "True",
        "absent",
        "stand-in: Transformer Engine is not installed (import stand-in)",
    ]


def test_files_may_follow_the_options_and_a_missing_one_is_named(tmp_path, capsys):
    (tmp_path / "tests" / "unit_tests" / "training").mkdir(parents=True)
    (tmp_path / "src" / "megatron" / "bridge").mkdir(parents=True)
    argv = [str(tmp_path), "--python", sys.executable, "--jobs", "1", "training/test_gone.py"]
    assert upstream_ci.main(argv) == 2
    assert capsys.readouterr().err == f"error: training/test_gone.py: no such file under {tmp_path}/tests/unit_tests\n"
