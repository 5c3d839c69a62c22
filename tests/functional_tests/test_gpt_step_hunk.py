"""The ``tools/upstream_hunks/gpt_step.diff`` hunk, in upstream's unit-test style: what Megatron-Bridge's
``gpt_step._forward_step_common`` hands the model, stock 0.6.2 beside 0.6.2 with our patch
(``gpt_step_hunk_check.py``, in the scratch interpreter of ``stock_bridge.py``)."""

import json

import pytest

from . import stock_bridge

CHECK = stock_bridge.ROOT / "tests" / "functional_tests" / "gpt_step_hunk_check.py"
ALL_COUNT = [[1.0] * 8]
DOCUMENTS = [0, 5, 8]


@pytest.fixture(scope="module")
def calls(tmp_path_factory):
    try:
        python = stock_bridge.scratch_env()
    except stock_bridge.RegistryUnreachable as exc:
        pytest.skip(f"the package registry cannot be reached: {exc}")
    out = {}
    for name, tree in (("stock", stock_bridge.site_packages(python)),
                       ("patched", stock_bridge.patched_tree(tmp_path_factory.mktemp("patched")))):  # fmt: skip
        run = stock_bridge.run(python, tree, CHECK)
        assert run.returncode == 0, run.stderr[-3000:]
        out[name] = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])
    return out


def test_stock_0_6_2_drops_the_packed_sequence_parameters_from_the_plan(calls):
    stock = calls["stock"]
    assert stock["packed=True mtp=False forward"]["cu_seqlens"] == DOCUMENTS
    assert not stock["packed=True mtp=False build_schedule_plan"]["has_packed_seq_params_key"]


def test_the_patch_hands_the_plan_the_packed_sequence_parameters_the_plain_path_gets(calls):
    patched = calls["patched"]
    for mtp in (False, True):
        assert patched[f"packed=True mtp={mtp} build_schedule_plan"]["cu_seqlens"] == DOCUMENTS
        assert patched[f"packed=True mtp={mtp} forward"]["cu_seqlens"] == DOCUMENTS
    # Padded microbatches: the keyword is there, and None (what the plan builder takes as "not packed").
    assert patched["packed=False mtp=False build_schedule_plan"] == {
        "loss_mask": ALL_COUNT, "cu_seqlens": None, "has_packed_seq_params_key": True,
    }  # fmt: skip


def test_the_patch_hands_the_plain_path_the_loss_mask_only_with_mtp(calls):
    stock, patched = calls["stock"], calls["patched"]
    for packed in (False, True):
        assert stock[f"packed={packed} mtp=True forward"]["loss_mask"] is None  # upstream's bug
        assert patched[f"packed={packed} mtp=True forward"]["loss_mask"] == ALL_COUNT
        assert patched[f"packed={packed} mtp=False forward"]["loss_mask"] is None  # no MTP: the forward as it was
        assert patched[f"packed={packed} mtp=True build_schedule_plan"]["loss_mask"] == ALL_COUNT
