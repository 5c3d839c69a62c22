"""``packed_guard.dropped_packed_sequence``: both sides, without a stock Megatron-Bridge (the stock-loop tests run it
in Bridge's real ``gpt_step``). A stand-in for Bridge's ``_forward_step_common`` is compiled into a module namespace
named as Bridge's, holding the local the guard reads; it calls a builder the way Bridge calls ``build_schedule_plan``.
"""

import torch

from megatron.bridge.training.ep_overlap.mcore.packed_guard import dropped_packed_sequence

FORWARD_STEP = """
def _forward_step_common(build, packed_seq_metadata, packed_seq_params):
    position_ids = None
    return build(packed_seq_params=packed_seq_params)
"""


def _builder(packed_seq_params=None):
    return dropped_packed_sequence(packed_seq_params)


def _forward_step(module: str):
    namespace = {"__name__": module}
    exec(compile(FORWARD_STEP, f"<{module}>", "exec"), namespace)
    return namespace["_forward_step_common"]


METADATA = {"cu_seqlens_q": torch.tensor([0, 5, 8])}


def test_a_packed_microbatch_whose_parameters_were_dropped_is_seen():
    assert _forward_step("megatron.bridge.training.gpt_step")(_builder, METADATA, None)


def test_no_false_alarm():
    stock = _forward_step("megatron.bridge.training.gpt_step")
    assert not stock(_builder, None, None)  # a padded microbatch: Bridge read no packed metadata
    assert not stock(_builder, METADATA, object())  # the parameters reached the builder (the patched gpt_step)
    assert not _forward_step("my_recipe.steps")(_builder, METADATA, None)  # a recipe's own forward step
    assert not _builder()  # called directly, outside any forward step
