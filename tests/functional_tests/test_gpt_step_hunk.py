"""The series' two ``gpt_step`` bug fixes (``tools/upstream_series.py``) stand on their own: each patch carries a test
in upstream's unit-test style, which fails on stock 0.6.2 and passes once its patch is committed, with nothing of the
feature there; the first fix alone leaves the second bug as it was. Run in the scratch interpreter of
``stock_bridge.py`` (``gpt_step_hunk_check.py``), each tree as the ``megatron.bridge`` it imports."""

import json

import pytest

from . import stock_bridge
from .stock_bridge import ROOT, upstream

CHECK = ROOT / "tests" / "functional_tests" / "gpt_step_hunk_check.py"
FIXES = [part for part in upstream.SERIES if part.fix]
MTP = "test_gpt_step_mtp_loss_mask.py::"
PACKED = "test_gpt_step_packed_schedule_plan.py::"


def _run(python, root, src):
    """The fixes' tests against the tree ``src``: the copies committed in ``root`` where there are, else ours."""
    tests = [(root / f if root and (root / f).exists() else ROOT / "tools" / "upstream_files" / f)
             for part in FIXES for f in part.files]  # fmt: skip
    run = stock_bridge.run(python, src, CHECK, *map(str, tests))
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    python = stock_bridge.scratch_env_or_skip()
    scratch = tmp_path_factory.mktemp("fixes")
    series = upstream.make_series(upstream.unpack_sources(scratch / "made"))
    assert [name.split("-", 1)[0] for name, _ in series[: len(FIXES)]] == ["0001", "0002"]
    fixes = [text for _, text in series[: len(FIXES)]]
    first = upstream.check_series(fixes[:1], upstream.unpack_sources(scratch / "first"))
    both = upstream.check_series(fixes, upstream.unpack_sources(scratch / "both"))
    assert not (both / upstream.PACKAGE / "training" / "ep_overlap").exists()  # nothing of the feature
    return {
        "stock": _run(python, None, stock_bridge.site_packages(python)),
        "first fix": _run(python, first, first / "src"),
        "both fixes": _run(python, both, both / "src"),
    }


def test_each_fix_test_fails_on_stock_0_6_2(outcomes):
    stock = outcomes["stock"]
    assert stock[MTP + "test_a_model_with_mtp_layers_gets_the_loss_mask_on_both_paths[False]"] == "failed"
    assert stock[MTP + "test_a_model_with_mtp_layers_gets_the_loss_mask_on_both_paths[True]"] == "passed"  # the plan
    assert stock[MTP + "test_without_mtp_layers_the_plain_forward_is_called_as_before"] == "passed"
    assert {t: s for t, s in stock.items() if t.startswith(PACKED)} == {
        PACKED + "test_the_plan_gets_the_document_boundaries_the_plain_forward_gets": "failed",
        PACKED + "test_a_padded_microbatch_builds_the_plan_without_them": "failed",
    }


def test_the_first_fix_alone_fixes_the_mtp_loss_mask_and_nothing_else(outcomes):
    first = outcomes["first fix"]
    assert {s for t, s in first.items() if t.startswith(MTP)} == {"passed"}
    assert {s for t, s in first.items() if t.startswith(PACKED)} == {"failed"}


def test_the_fixes_pass_their_tests_without_the_feature(outcomes):
    both = outcomes["both fixes"]
    assert len(both) == 5 and set(both.values()) == {"passed"}
