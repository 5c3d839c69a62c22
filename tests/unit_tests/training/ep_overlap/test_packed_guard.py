"""``packed_guard.dropped_packed_sequence``: decided from what the plan builder is given, both sides and the trade-off
(the stock-loop tests run it in Megatron-Bridge 0.6.2's real ``gpt_step``; ``test_mcore_hook.py`` through the
builder).
"""

import torch

from megatron.bridge.training.ep_overlap.mcore.packed_guard import DROPPED, NOT_GIVEN, dropped_packed_sequence

PADDED = torch.arange(8)[None].expand(2, 8)
PACKED = torch.cat([torch.arange(5), torch.arange(3)])[None]  # two documents in one row, each numbered from 0
MASK = torch.ones(8, 8, dtype=torch.bool).triu(1)[None, None]


def test_a_packed_microbatch_whose_parameters_were_dropped_is_seen():
    # Stock 0.6.2's call: no packed_seq_params keyword, no attention mask, position ids restarting inside the row.
    assert dropped_packed_sequence(NOT_GIVEN, PACKED, None)
    assert dropped_packed_sequence(NOT_GIVEN, torch.cat([PADDED[:1], PACKED]), None)  # any row of the microbatch
    # Bridge's in-batch packing pads the row's tail with position id 0: a restart too.
    assert dropped_packed_sequence(NOT_GIVEN, torch.tensor([[0, 1, 2, 3, 4, 5, 0, 0]]), None)


def test_no_false_alarm():
    assert not dropped_packed_sequence(NOT_GIVEN, PADDED, None)  # a padded microbatch counts up
    assert not dropped_packed_sequence(NOT_GIVEN, torch.tensor([[0, 1, 6, 7]]), None)  # a context-parallel slice
    assert not dropped_packed_sequence(None, PACKED, None)  # the keyword was passed (the patched gpt_step)
    assert not dropped_packed_sequence(object(), PACKED, None)  # ... with the parameters
    assert not dropped_packed_sequence(NOT_GIVEN, PACKED, MASK)  # a mask says what attends to what
    assert not dropped_packed_sequence(NOT_GIVEN, None, None)  # a stage given no position ids cannot tell
    assert not dropped_packed_sequence(NOT_GIVEN, torch.zeros(1, 1, dtype=torch.long), None)  # one token


def test_reset_position_ids_without_a_mask_are_refused_where_the_keyword_is_missing():
    """The trade-off: data with reset position ids and no attention mask looks like a packed row whose boundaries
    were dropped. Refused only where the caller did not say (passing packed_seq_params=None says it), and the
    refusal names that way out."""
    reset = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    assert dropped_packed_sequence(NOT_GIVEN, reset, None)
    assert not dropped_packed_sequence(None, reset, None)
    assert "reset position ids and no attention mask" in DROPPED and "packed_seq_params=None" in DROPPED
    assert "fix: apply this project's patch (tools/upstream.py patch" in DROPPED


FORWARD_STEP = """
def _forward_step_common(build, packed_seq_metadata, position_ids):
    return build(position_ids)
"""


def test_the_callers_variables_are_not_read():
    # A stand-in for Bridge's forward step, in a module named as Bridge's, with packed metadata in a local (what the
    # guard used to read up the stack): it decides from the builder's arguments alone, either way.
    namespace = {"__name__": "megatron.bridge.training.gpt_step"}
    exec(compile(FORWARD_STEP, "<gpt_step>", "exec"), namespace)
    metadata = {"cu_seqlens_q": torch.tensor([0, 5, 8])}
    forward_step = namespace["_forward_step_common"]

    def build(position_ids):
        return dropped_packed_sequence(NOT_GIVEN, position_ids, None)

    assert not forward_step(build, metadata, PADDED)
    assert forward_step(build, None, PACKED)
