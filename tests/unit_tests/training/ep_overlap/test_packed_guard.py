"""``packed_guard.dropped_packed_sequence``: decided from what the plan builder is given, both sides and the trade-off
(the stock-loop tests run it in Megatron-Bridge 0.6.2's real ``gpt_step``; ``test_mcore_hook.py`` through the
builder); ``PackedGuard``: read in a position-ids shape's first step only, none after.
"""

from datetime import timedelta

import torch

from megatron.bridge.training.ep_overlap.mcore.agreement import announced
from megatron.bridge.training.ep_overlap.mcore.packed_guard import (
    DROPPED,
    NOT_GIVEN,
    PackedGuard,
    dropped_packed_sequence,
)

from .host_reads import spy
from .local_ranks import run_local_ranks
from .mcore_cpu import init_megatron, install_cpu_stubs
from .mcore_models import McoreCase, build_model
from .test_mcore_hook import SEQ
from .test_new_families import unmasked_forward_step  # stock gpt_step's call: no mask, no packed_seq_params

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


def test_the_guard_checks_a_shapes_first_steps_microbatches_and_then_reads_nothing():
    guard = PackedGuard()  # no count announced and no calculator: one microbatch per shape
    with spy() as records:
        assert not guard.dropped(NOT_GIVEN, PADDED, None)
    assert len(records) == 1
    with spy() as records:
        assert not guard.dropped(NOT_GIVEN, PADDED, None)  # the same shape again: nothing read
        assert not guard.dropped(NOT_GIVEN, PACKED, MASK)  # decided on the host
    assert records == []
    assert guard.dropped(NOT_GIVEN, PACKED, None)  # a shape not seen before is read
    with announced(3):
        guard = PackedGuard()
        assert [guard.dropped(NOT_GIVEN, p, None) for p in (PADDED, PADDED, PACKED[:, :8].expand(2, 8))] == [
            False,
            False,
            True,  # the step's third microbatch of that shape is still read
        ]


STEPS, MICROBATCHES = 3, 3


def guard_reads_per_step(rank: int, world: int) -> list[int]:
    """The packed guard's host reads in each step of Megatron-Core's driver with the plan (Megatron-Core's
    num-microbatches calculator set, as Bridge's ``train()`` sets it)."""
    install_cpu_stubs()
    init_megatron(world)
    from megatron.core import num_microbatches_calculator as calculator
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron.bridge.training.ep_overlap.mcore import use_ep_overlap_schedule

    calculator.init_num_microbatches_calculator(0, None, MICROBATCHES * 2, 2, 1)
    model = build_model(McoreCase(microbatches=MICROBATCHES))
    model.config.overlap_moe_expert_parallel_comm = True
    use_ep_overlap_schedule([model], timeout=timedelta(seconds=30))
    reads = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(10 * step + rank)
        data = [tuple(torch.randint(0, 64, (2, 2, SEQ), generator=gen)) for _ in range(MICROBATCHES)]
        with spy() as records:
            get_forward_backward_func()(
                forward_step_func=unmasked_forward_step, data_iterator=iter(data), model=[model],
                num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=2, forward_only=False,
            )  # fmt: skip
        reads.append(sum("packed_guard.py" in where for _, where in records))
    return reads


def test_through_megatron_cores_driver_the_guard_reads_the_device_in_the_first_step_only():
    # Finding 5 of issue 63: it read each microbatch's position ids, every step (a device sync each, on a GPU).
    for outcome in run_local_ranks(guard_reads_per_step, 2):
        assert outcome.result == [MICROBATCHES, 0, 0], outcome.result
