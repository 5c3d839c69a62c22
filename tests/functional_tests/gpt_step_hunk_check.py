"""What ``gpt_step._forward_step_common`` hands the model, for the ``gpt_step.diff`` hunk (test-only).

    python gpt_step_hunk_check.py TREE

Run by ``test_gpt_step_hunk.py`` in the scratch interpreter of ``stock_bridge.py``, once with stock 0.6.2 and once
with the patched sources. In upstream's unit-test style: Bridge's own ``_forward_step_common`` and
``get_packed_seq_params``, a recording model, a mocked ``GlobalState``, and a ``_get_batch_fn`` (the hook upstream's
function has for this) returning a packed or a padded microbatch. Prints one JSON line: per case, the keyword
arguments each path passed to the model.
"""

import json
from unittest import mock

import torch


class RecordingModel(torch.nn.Module):
    def __init__(self, mtp: bool):
        super().__init__()
        self.config = mock.MagicMock(mtp_num_layers=1 if mtp else None, is_hybrid_model=False, seq_length=8,
                                     overlap_moe_expert_parallel_comm=True)  # fmt: skip
        self.pg_collection = mock.MagicMock()
        self.pg_collection.cp.size.return_value = 1
        self.calls = []

    def forward(self, **kwargs):
        self.calls.append(("forward", kwargs))
        return torch.zeros(1)

    def build_schedule_plan(self, *args, **kwargs):
        self.calls.append(("build_schedule_plan", kwargs))
        return "plan"


def batch(packed: bool):
    tokens = torch.arange(8)[None]
    meta = None
    if packed:  # two documents of 5 and 3 tokens in one row
        cu_seqlens = torch.tensor([0, 5, 8], dtype=torch.int32)
        meta = {"cu_seqlens_q": cu_seqlens, "cu_seqlens_kv": cu_seqlens, "max_seqlen_q": 5, "max_seqlen_kv": 5}
    return tokens, tokens, torch.ones(1, 8), None, torch.arange(8)[None], meta


def describe(kwargs: dict) -> dict:
    packed = kwargs.get("packed_seq_params")
    return {
        "loss_mask": None if kwargs.get("loss_mask") is None else kwargs["loss_mask"].tolist(),
        "cu_seqlens": None if packed is None else packed.cu_seqlens_q.tolist(),
        "has_packed_seq_params_key": "packed_seq_params" in kwargs,
    }


def main() -> None:
    from megatron.bridge.training import gpt_step

    out = {}
    for packed in (False, True):
        for mtp in (False, True):
            for plan in (False, True):
                model = RecordingModel(mtp)

                def get_batch(*args, packed=packed, **kwargs):
                    return batch(packed)

                with mock.patch.object(gpt_step, "accumulate_flops_metadata"):  # FLOP counting: not under test
                    gpt_step._forward_step_common(mock.MagicMock(), iter(()), model, plan, _get_batch_fn=get_batch)
                ((path, kwargs),) = model.calls
                out[f"packed={packed} mtp={mtp} {path}"] = describe(kwargs)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
