"""``gpt_step._forward_step_common`` builds the schedule plan (EP communication overlap) with the packed-sequence
parameters the plain forward gets: without them every packed document attends to the ones before it in its row."""

from unittest import mock

import torch

from megatron.bridge.training import gpt_step

DOCUMENTS = [0, 5, 8]  # two documents, of 5 and 3 tokens, in one row


class RecordingModel(torch.nn.Module):
    """Records the keyword arguments of each call the forward step makes."""

    def __init__(self):
        super().__init__()
        self.config = mock.MagicMock(mtp_num_layers=None, is_hybrid_model=False, seq_length=8,
                                     overlap_moe_expert_parallel_comm=True)  # fmt: skip
        self.pg_collection = mock.MagicMock()
        self.pg_collection.cp.size.return_value = 1
        self.calls = []

    def forward(self, **kwargs):
        self.calls.append(("forward", kwargs))
        return torch.zeros(1)

    def build_schedule_plan(self, *args, **kwargs):
        self.calls.append(("build_schedule_plan", kwargs))
        return mock.MagicMock()


def batch(packed):
    tokens = torch.arange(8)[None]
    metadata = None
    if packed:
        cu_seqlens = torch.tensor(DOCUMENTS, dtype=torch.int32)
        metadata = {"cu_seqlens_q": cu_seqlens, "cu_seqlens_kv": cu_seqlens, "max_seqlen_q": 5, "max_seqlen_kv": 5}
    return tokens, tokens, torch.ones(1, 8), None, torch.arange(8)[None], metadata


def step(packed, return_schedule_plan):
    model = RecordingModel()
    with mock.patch.object(gpt_step, "accumulate_flops_metadata"):  # FLOP counting: not under test
        gpt_step._forward_step_common(mock.MagicMock(), iter(()), model, return_schedule_plan,
                                      _get_batch_fn=lambda *args, **kwargs: batch(packed))  # fmt: skip
    ((_, kwargs),) = model.calls
    return kwargs


def test_the_plan_gets_the_document_boundaries_the_plain_forward_gets():
    plain = step(packed=True, return_schedule_plan=False)["packed_seq_params"]
    plan = step(packed=True, return_schedule_plan=True)["packed_seq_params"]
    assert plain.cu_seqlens_q.tolist() == plan.cu_seqlens_q.tolist() == DOCUMENTS
    assert plan.cu_seqlens_kv.tolist() == DOCUMENTS and plan.qkv_format == plain.qkv_format


def test_a_padded_microbatch_builds_the_plan_without_them():
    assert step(packed=False, return_schedule_plan=True)["packed_seq_params"] is None
