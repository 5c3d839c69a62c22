"""CommOverlapConfig.setup: resolution of TP/PP/DP overlap, MoE rules, and respect for model-config values."""

import logging
from types import SimpleNamespace

import pytest
import torch
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.bridge.training.comm_overlap import CommOverlapConfig, CommOverlapConfigError, comm_overlap_violations


def moe_model(**overrides) -> TransformerConfig:
    settings = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_moe_experts=8,
        moe_ffn_hidden_size=128,
        moe_router_topk=2,
        expert_model_parallel_size=2,
        moe_token_dispatcher_type="alltoall",
        bf16=True,
        add_bias_linear=False,
        pipeline_dtype=torch.bfloat16,
    )
    settings.update(overrides)
    return TransformerConfig(**settings)


def test_enables_ep_overlap_and_delayed_wgrad(fake_versions):
    model = moe_model()
    CommOverlapConfig(tp_comm_overlap=False, overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True).setup(
        model
    )
    assert model.overlap_moe_expert_parallel_comm is True
    assert model.delay_wgrad_compute is True


def test_three_violations_in_one_error_and_nothing_written(fake_versions):
    model = moe_model(expert_model_parallel_size=1, moe_token_dispatcher_type="allgather", bf16=False)
    cfg = CommOverlapConfig(tp_comm_overlap=False, overlap_moe_expert_parallel_comm=True)
    with pytest.raises(CommOverlapConfigError) as raised:
        cfg.setup(model)
    names = [v.name for v in raised.value.violations]
    assert names == ["expert_parallel", "token_dispatcher", "precision"]
    message = str(raised.value)
    for field in ("expert_model_parallel_size=1", "moe_token_dispatcher_type='allgather'", "model.bf16=False"):
        assert field in message
    assert message.count("Fix: ") == 3
    assert model.overlap_moe_expert_parallel_comm is False  # validation happens before any write


def test_violations_function_does_not_raise_or_write(fake_versions):
    model = moe_model(expert_model_parallel_size=1)
    cfg = CommOverlapConfig(tp_comm_overlap=False, overlap_moe_expert_parallel_comm=True)
    found = comm_overlap_violations(cfg, model)
    assert [v.name for v in found] == ["expert_parallel"]
    assert model.overlap_moe_expert_parallel_comm is False


def test_delay_wgrad_without_overlap_is_reported(fake_versions):
    cfg = CommOverlapConfig(tp_comm_overlap=False, delay_wgrad_compute=True)
    assert [v.name for v in comm_overlap_violations(cfg, moe_model())] == ["delay_wgrad_needs_overlap"]


def test_model_value_stands_when_comm_overlap_leaves_field_auto(fake_versions):
    model = moe_model(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)
    CommOverlapConfig(tp_comm_overlap=False).setup(model)
    assert model.overlap_moe_expert_parallel_comm is True
    assert model.delay_wgrad_compute is True


def test_model_and_comm_overlap_disagreeing_is_an_error(fake_versions):
    model = moe_model(overlap_moe_expert_parallel_comm=True)
    cfg = CommOverlapConfig(tp_comm_overlap=False, overlap_moe_expert_parallel_comm=False)
    with pytest.raises(CommOverlapConfigError) as raised:
        cfg.setup(model)
    (violation,) = raised.value.violations
    assert violation.name == "conflict"
    text = str(violation)
    assert "TransformerConfig.overlap_moe_expert_parallel_comm=True" in text
    assert "comm_overlap.overlap_moe_expert_parallel_comm=False" in text
    assert "leave comm_overlap.overlap_moe_expert_parallel_comm=None" in text


def test_non_dataclass_model_values_count_as_set(fake_versions):
    model = SimpleNamespace(**vars(moe_model()))
    model.overlap_p2p_comm = True
    CommOverlapConfig(tp_comm_overlap=False).setup(model)
    assert model.overlap_p2p_comm is True


@pytest.mark.parametrize(
    "overrides, te, expected, reason",
    [
        (dict(tensor_model_parallel_size=1), "2.8.0", False, "tensor_model_parallel_size < 2"),
        (dict(tensor_model_parallel_size=2), "2.8.0", False, "sequence_parallel=False"),
        (
            dict(tensor_model_parallel_size=2, sequence_parallel=True),
            None,
            False,
            "Transformer Engine is not installed",
        ),
        (dict(tensor_model_parallel_size=2, sequence_parallel=True), "2.8.0", True, None),
    ],
)
def test_tp_overlap_resolution(fake_versions, caplog, overrides, te, expected, reason):
    fake_versions(te=te)
    model = moe_model(**overrides)
    with caplog.at_level(logging.WARNING):
        CommOverlapConfig(tp_comm_overlap=True).setup(model)
    assert model.tp_comm_overlap is expected
    if reason:
        assert reason in caplog.text


@pytest.mark.parametrize(
    "pp, vpp, overlap_p2p, batch_p2p",
    [(1, None, False, False), (2, None, False, True), (2, 2, True, False)],
)
def test_pp_overlap_resolution(fake_versions, pp, vpp, overlap_p2p, batch_p2p):
    model = moe_model(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp, num_layers=4)
    CommOverlapConfig(tp_comm_overlap=False).setup(model)
    assert (model.overlap_p2p_comm, model.batch_p2p_comm) == (overlap_p2p, batch_p2p)


def test_user_pp_value_overrides_auto(fake_versions):
    model = moe_model(pipeline_model_parallel_size=2, num_layers=4)
    CommOverlapConfig(tp_comm_overlap=False, batch_p2p_comm=False).setup(model)
    assert model.batch_p2p_comm is False


@pytest.mark.parametrize("dp, pp, vpp", [(1, 1, None), (4, 1, None), (4, 2, 2)])
def test_dp_overlap_resolution(fake_versions, dp, pp, vpp):
    model = moe_model(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp, num_layers=4)
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True)
    opt = OptimizerConfig()
    CommOverlapConfig(tp_comm_overlap=False, data_parallel_size=dp).setup(model, opt, ddp)
    assert ddp.overlap_grad_reduce is (dp > 1)
    assert ddp.overlap_param_gather is (dp > 1)
    assert ddp.bucket_size == (128 * 1024 * 1024 if dp > 1 else None)
    assert ddp.align_param_gather is (dp > 1 and pp > 1)


def test_dp_overlap_needs_distributed_optimizer(fake_versions):
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=False)
    CommOverlapConfig(tp_comm_overlap=False, data_parallel_size=4).setup(moe_model(), OptimizerConfig(), ddp)
    assert ddp.overlap_grad_reduce is False


def test_resolved_grad_reduce_feeds_the_te_rule(fake_versions):
    fake_versions(te="2.6.0")
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True)
    cfg = CommOverlapConfig(
        tp_comm_overlap=False, data_parallel_size=2, overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True
    )
    found = comm_overlap_violations(cfg, moe_model(), OptimizerConfig(), ddp)
    assert [v.name for v in found] == ["delay_wgrad_grad_reduce_te"]


def test_finalize_reports_all_bad_own_values():
    cfg = CommOverlapConfig(tp_comm_overlap=False, bucket_size=0, data_parallel_size=0, tp_comm_bootstrap_backend="x")
    with pytest.raises(CommOverlapConfigError) as raised:
        cfg.finalize()
    assert [v.name for v in raised.value.violations] == [
        "data_parallel_size",
        "bucket_size",
        "tp_comm_bootstrap_backend",
    ]


def test_finalize_accepts_defaults():
    CommOverlapConfig(tp_comm_overlap=False).finalize()


def test_tp_overlap_cfg_is_written_when_tp_overlap_is_on(fake_versions):
    fake_versions(te="2.8.0")
    model = moe_model(tensor_model_parallel_size=2, sequence_parallel=True)
    overlap_cfg = {"qkv_dgrad": {"method": "bulk"}}
    CommOverlapConfig(tp_comm_overlap=True, tp_comm_overlap_cfg=overlap_cfg, tp_comm_bootstrap_backend="nccl").setup(
        model
    )
    assert model.tp_comm_overlap_cfg == overlap_cfg
    assert model.tp_comm_bootstrap_backend == "nccl"
