"""``gpt_step._forward_step_common`` hands a model with multi-token prediction (MTP) layers the loss mask on the plain
path, as it does when it builds the schedule plan: Megatron-Core's MTP loss reads the mask inside the model, and
without it every token counts, masked ones too, so the MTP loss would differ with the EP overlap on and off."""

from unittest import mock

import pytest
import torch

from megatron.bridge.training import gpt_step

LOSS_MASK = [[1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0]]


class RecordingModel(torch.nn.Module):
    """Records the keyword arguments of each call the forward step makes."""

    def __init__(self, mtp_num_layers):
        super().__init__()
        self.config = mock.MagicMock(mtp_num_layers=mtp_num_layers, is_hybrid_model=False, seq_length=8,
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


def get_batch(*args, **kwargs):
    tokens = torch.arange(8)[None]
    return tokens, tokens, torch.tensor(LOSS_MASK), None, torch.arange(8)[None], None


def step(mtp_num_layers, return_schedule_plan):
    model = RecordingModel(mtp_num_layers)
    with mock.patch.object(gpt_step, "accumulate_flops_metadata"):  # FLOP counting: not under test
        gpt_step._forward_step_common(mock.MagicMock(), iter(()), model, return_schedule_plan, _get_batch_fn=get_batch)
    ((call, kwargs),) = model.calls
    return call, kwargs


@pytest.mark.parametrize("return_schedule_plan", [False, True])
def test_a_model_with_mtp_layers_gets_the_loss_mask_on_both_paths(return_schedule_plan):
    call, kwargs = step(mtp_num_layers=1, return_schedule_plan=return_schedule_plan)
    assert call == ("build_schedule_plan" if return_schedule_plan else "forward")
    assert kwargs["loss_mask"].tolist() == LOSS_MASK


def test_without_mtp_layers_the_plain_forward_is_called_as_before():
    call, kwargs = step(mtp_num_layers=None, return_schedule_plan=False)
    assert call == "forward" and "loss_mask" not in kwargs
