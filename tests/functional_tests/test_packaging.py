"""Shipping beside a stock Megatron-Bridge 0.6.2 (from the package registry) and as a patch for a fork of it.

A scratch environment gets upstream's wheel and this project's plugin wheel, both with ``--no-deps``; torch and
Megatron-Core come from this project's venv (added to the path, its own .pth files unread). Skipped with the
reason when the registry cannot be reached.

Upstream's package ``__init__`` files import every model bridge (transformers, Transformer Engine, ...), which a
CPU test environment does not have. The import tests therefore register ``megatron.bridge`` and its subpackages
as bare packages over the installed folders, so every module is the installed file, and stub the three model
config classes that upstream's ``comm_overlap.py`` imports only for type annotations. Nothing stands in for
Transformer Engine.
"""

import email
import hashlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .stock_bridge import ROOT, VENV_SITE, _pip, site_packages, upstream


@pytest.fixture(scope="module")
def wheels():
    try:
        return upstream.upstream_wheel(), upstream.build_plugin(ROOT / "build" / "plugin-test")
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"the package registry cannot be reached: {exc.stderr.strip().splitlines()[-1:]}")


@pytest.fixture(scope="module")
def scratch(wheels, tmp_path_factory):
    """A venv with upstream 0.6.2 installed; returns (python, site-packages)."""
    env = tmp_path_factory.mktemp("scratch")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    python = env / "bin" / "python"
    site = site_packages(python)
    (site / "base.pth").write_text(f"{VENV_SITE}\n")  # a path entry: the .pth files inside it are not read
    _pip(python, "install", "--no-deps", str(wheels[0]))
    return python, site


def _record(site: Path, distribution: str) -> dict[str, str]:
    """Installed files of a distribution (its RECORD), path -> sha256 of the file on disk now."""
    info = next(site.glob(f"{distribution}-*.dist-info"))
    files = [line.split(",")[0] for line in (info / "RECORD").read_text().splitlines() if line]
    return {
        f: hashlib.sha256((site / f).read_bytes()).hexdigest()
        for f in files
        if ".dist-info/" not in f and not f.endswith(".pyc") and (site / f).exists()
    }


def test_the_plugin_installs_and_uninstalls_without_touching_upstream(scratch, wheels):
    python, site = scratch
    before = _record(site, "megatron_bridge")
    _pip(python, "install", "--no-deps", str(wheels[1]))
    ours = _record(site, "megatron_bridge_ep_overlap")
    assert ours and not set(ours) & set(before), "a file belongs to both distributions"
    assert "megatron/bridge/training/comm_overlap.py" in before and "megatron/bridge/__init__.py" in before
    assert _record(site, "megatron_bridge") == before
    _pip(python, "uninstall", "-y", "megatron-bridge-ep-overlap")
    assert _record(site, "megatron_bridge") == before  # every upstream file still there, byte for byte
    assert not (site / "megatron/bridge/training/ep_overlap").exists()
    _pip(python, "install", "--no-deps", str(wheels[1]))  # for the tests below


BOOTSTRAP = textwrap.dedent(
    """
    import sys, types
    from pathlib import Path
    site = Path(sys.argv[1])
    for name in ("megatron.bridge", "megatron.bridge.models", "megatron.bridge.models.gpt",
                 "megatron.bridge.models.hybrid", "megatron.bridge.training", "megatron.bridge.utils"):
        package = types.ModuleType(name)
        package.__path__ = [str(site / name.replace(".", "/"))]
        sys.modules[name] = package
    stubs = {"megatron.bridge.models": ("GPTModelProvider", "T5ModelProvider"),
             "megatron.bridge.models.gpt.gpt_builder": ("GPTModelConfig",),
             "megatron.bridge.models.hybrid.hybrid_builder": ("HybridModelConfig",)}
    for module, classes in stubs.items():
        target = sys.modules.setdefault(module, types.ModuleType(module))
        for cls in classes:
            setattr(target, cls, type(cls, (), {}))
    """
)


def _run_there(python: Path, site: Path, body: str) -> str:
    run = subprocess.run([python, "-c", BOOTSTRAP + textwrap.dedent(body), str(site)], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def test_our_modules_import_from_the_installed_tree(scratch):
    python, site = scratch
    out = _run_there(python, site, """
        import ep_overlap_lab.engine.driver as engine
        import ep_overlap_lab.planner as planner
        import megatron.bridge.training.moe_overlap_rules as rules
        import ep_overlap_lab.moe_gpt.model as model
        import megatron.bridge.training.ep_overlap.mcore.hook as hook  # the pre-wrap hook a recipe registers
        for module in (engine, planner, rules, model, hook):
            assert str(site) in module.__file__, module.__file__
        print("ok")
    """)  # fmt: skip
    assert out.strip() == "ok"


def test_a_recipe_gets_the_single_error_on_upstreams_own_comm_overlap(scratch):
    python, site = scratch
    out = _run_there(python, site, """
        import torch
        import megatron.bridge.training.comm_overlap as stock
        from megatron.bridge.training.ep_overlap_config import EPOverlapCommOverlapConfig
        from megatron.bridge.training.moe_overlap_rules import CommOverlapConfigError
        from megatron.core.transformer.transformer_config import TransformerConfig
        assert str(site) in stock.__file__ and not hasattr(stock, "checks_ep_overlap_rules")  # upstream's file

        def model(**overrides):
            settings = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=8,
                            moe_ffn_hidden_size=128, expert_model_parallel_size=2,
                            moe_token_dispatcher_type="alltoall", bf16=True, add_bias_linear=False)
            settings.update(overrides)
            return TransformerConfig(**settings)

        # As the install docs show it: the recipe's comm_overlap is our subclass; the rest is stock.
        bad = model(expert_model_parallel_size=1, moe_token_dispatcher_type="allgather", recompute_modules=["moe"])
        try:
            EPOverlapCommOverlapConfig(tp_comm_overlap=False, overlap_moe_expert_parallel_comm=True).setup(bad)
        except AssertionError as exc:
            assert isinstance(exc, CommOverlapConfigError)
            print(sorted(v.name for v in exc.violations))
        good = model()
        EPOverlapCommOverlapConfig(tp_comm_overlap=False, overlap_moe_expert_parallel_comm=True).setup(good)
        print(good.overlap_moe_expert_parallel_comm, good.delay_wgrad_compute)
        explicit = model(batch_p2p_comm=False, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                         num_layers=4, pipeline_dtype=torch.bfloat16)
        EPOverlapCommOverlapConfig(tp_comm_overlap=False).setup(explicit)
        print(explicit.batch_p2p_comm, explicit.overlap_p2p_comm)
    """)  # fmt: skip
    lines = out.splitlines()
    assert lines[0] == "['expert_parallel', 'no_moe_recompute', 'token_dispatcher']"
    assert lines[1] == "True False"
    assert lines[2] == "False True"  # the model's explicit value stands; the auto value still applies elsewhere


def test_the_patch_applies_to_a_fresh_unpack(wheels, tmp_path):
    patch = upstream.build_patch(tmp_path / "ep-overlap.patch").read_text()  # checks `git apply --check` itself
    assert "diff --git a/src/megatron/bridge/training/comm_overlap.py" in patch
    new = "--- /dev/null\n+++ b/"
    assert new + "src/megatron/bridge/training/ep_overlap/runtime/lanes.py" in patch
    assert new + "tests/unit_tests/training/ep_overlap/test_comm_overlap_rules.py" in patch  # its tests travel with it
    assert "+++ b/src/ep_overlap_lab/" not in patch  # the lab stays in this project
    assert "a/src/megatron/bridge/__init__.py" not in patch


@pytest.fixture(scope="module")
def series(wheels, tmp_path_factory):
    """``make patch``'s output: the one file, and the patches in order."""
    path = upstream.build_patch(tmp_path_factory.mktemp("series") / "ep-overlap.patch")
    return path, [p.read_text() for p in sorted(path.with_suffix("").glob("*.patch"))]


def _touched(patch: str) -> set[str]:
    return {line[6:].strip() for line in patch.splitlines() if line.startswith(("+++ b/", "--- a/"))}


def _changed(patch: str, path: str) -> list[str]:
    """The lines ``patch`` adds to or removes from ``path``."""
    lines, inside = [], False
    for line in patch.splitlines():
        if line.startswith("diff --git "):
            inside = line.endswith(f" b/{path}")
        elif inside and line[:1] in "+-" and not line.startswith(("+++ ", "--- ")):
            lines.append(line)
    return lines


def _subject(patch: str) -> str:
    return " ".join(email.message_from_string(patch)["Subject"].split())


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout


def test_make_patch_writes_a_series_that_commits_in_order_onto_stock_0_6_2(series, tmp_path):
    path, patches = series
    assert len(patches) == len(upstream.SERIES) >= 3 and "".join(patches) == path.read_text()
    for number, patch in enumerate(patches, 1):
        assert patch.startswith("From ") and f"Subject: [PATCH {number}/{len(patches)}] " in patch
    tree = upstream.check_series(patches, upstream.unpack_sources(tmp_path / "am"))  # git am, one commit each
    subjects = _git(tree, "log", "--reverse", "--format=%s").splitlines()
    assert subjects == [f"megatron-bridge {upstream.VERSION}", *(part.subject for part in upstream.SERIES)]
    assert not _git(tree, "status", "--porcelain")
    # The one file, applied at once, gives the same tree.
    at_once = upstream.unpack_sources(tmp_path / "apply")
    subprocess.run(["git", "apply", "-"], cwd=at_once, input=path.read_text(), text=True, check=True)
    touched = set().union(*map(_touched, patches))
    assert all((tree / f).read_bytes() == (at_once / f).read_bytes() for f in touched)


GPT_STEP = "src/megatron/bridge/training/gpt_step.py"
UNIT = "tests/unit_tests/training"
UPSTREAMS_STEPS = {GPT_STEP, "src/megatron/bridge/training/train.py", "src/megatron/bridge/training/setup.py",
                   "src/megatron/bridge/models/qwen_vl/qwen3_vl_step.py"}  # fmt: skip


def test_the_series_starts_with_the_bug_fixes_each_touching_only_what_its_title_says(series):
    mtp, packed, feature, vision, pipeline = series[1]
    assert _subject(mtp) == "[PATCH 1/5] gpt_step: pass the loss mask to the plain forward of MTP models"
    assert _touched(mtp) == {GPT_STEP, f"{UNIT}/test_gpt_step_mtp_loss_mask.py"}
    assert any('forward_args["loss_mask"]' in line for line in _changed(mtp, GPT_STEP))
    assert not any("build_schedule_plan" in line or "packed_seq" in line for line in _changed(mtp, GPT_STEP))

    assert _subject(packed) == "[PATCH 2/5] gpt_step: build the schedule plan with the packed-sequence parameters"
    assert _touched(packed) == {GPT_STEP, f"{UNIT}/test_gpt_step_packed_schedule_plan.py"}
    assert any("packed_seq_params=" in line for line in _changed(packed, GPT_STEP))
    assert not any("use_mtp" in line or 'forward_args["loss_mask"]' in line for line in _changed(packed, GPT_STEP))

    # The feature: the payload and its tests; of upstream's files only the two it ships whole.
    payload, changed = {str(f) for f in upstream.payload_files()}, _touched(feature)
    assert changed <= payload and not payload & UPSTREAMS_STEPS
    assert {f"{upstream.PACKAGE}/training/{f}" for f in ("comm_overlap.py", "ep_overlap/mcore/hook.py")} <= changed
    assert _touched(vision) == {"src/megatron/bridge/models/qwen_vl/qwen3_vl_step.py"}
    assert _touched(pipeline) == {"src/megatron/bridge/training/setup.py", "src/megatron/bridge/training/train.py"}
    assert "Why train.py changes:" in pipeline  # its description says why the feature needs it


def test_the_bug_fixes_alone_commit_onto_stock_0_6_2(series, tmp_path):
    fixes = series[1][:2]
    alone = upstream.check_series(fixes, upstream.unpack_sources(tmp_path / "fixes"))
    assert _git(alone, "diff", "--name-only", "HEAD~2").split() == [
        GPT_STEP, f"{UNIT}/test_gpt_step_mtp_loss_mask.py", f"{UNIT}/test_gpt_step_packed_schedule_plan.py"
    ]  # fmt: skip
    compile((alone / GPT_STEP).read_text(), GPT_STEP, "exec")
    for fix in fixes:  # and each one without the other
        upstream.check_series([fix], upstream.unpack_sources(tmp_path / str(fixes.index(fix))))


def _first_lines_without_the_header(root: Path, files: list[str]) -> list[str]:
    """Files whose first line lacks what upstream's copyright check looks for."""
    import re

    header = re.compile(r"Copyright.*NVIDIA CORPORATION.*All rights reserved\.")
    return [f for f in files if not header.search((root / f).read_text().splitlines()[0])]


def test_the_patched_tree_passes_upstreams_copyright_check(wheels, tmp_path):
    patch = upstream.build_patch(tmp_path / "ep-overlap.patch").read_text()
    root = upstream.unpack_sources(tmp_path / "tree")
    subprocess.run(["git", "apply", "-"], cwd=root, input=patch, text=True, check=True, capture_output=True)
    touched = sorted({line[6:] for line in patch.splitlines() if line.startswith("+++ b/")})
    code = [f for f in touched if f.endswith(".py")]
    assert code and set(touched) - set(code) == {f for f in touched if "/ep_overlap/golden/" in f}  # and golden data
    assert _first_lines_without_the_header(root, code) == []
    assert "\n-# Copyright" not in patch  # upstream's two files keep their header
    # The project's own files stay as they are: the header is added when the patch is made.
    assert _first_lines_without_the_header(ROOT, [str(upstream.PACKAGE / "training/ep_overlap/options.py")])


def test_a_patch_for_another_upstream_tree_says_which_hunks_need_a_rebase(wheels, tmp_path):
    tree = upstream.unpack_sources(tmp_path / "tree")  # stands in for a checkout of upstream's main
    flex = tree / upstream.PACKAGE / "training/flex_dispatcher_backend.py"
    flex.write_text(flex.read_text().replace("def _fallback_to_alltoall", "def _fallback_to_all_to_all"))
    out, rebase = upstream.patch_against(tree, tmp_path / "for-tree.patch")
    upstream.check_applies(out.read_text(), tree)
    assert rebase == {str(upstream.PACKAGE / "training/flex_dispatcher_backend.py"): 1}
    assert upstream.main(["patch", "--against", str(tmp_path / "nowhere")]) == 2
