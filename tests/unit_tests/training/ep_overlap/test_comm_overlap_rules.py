"""CommOverlapConfig: resolution of TP/PP/DP overlap, MoE rules, input types, and respect for model-config values."""

import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.models.gpt import GPTModelConfig

from megatron.bridge.training import comm_overlap
from megatron.bridge.training.comm_overlap import (
    CommOverlapConfig,
    CommOverlapConfigError,
    comm_overlap_violations,
    userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192,
    userbuffers_fp8_h100_h16384_tp4_mbs1_seqlen2048_lora,
)
from megatron.bridge.utils.config_values import is_explicitly_set, mark_explicit


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
    "overrides, have_te, expected, reason",
    [
        (dict(tensor_model_parallel_size=1), True, False, "TP size < 2"),
        (dict(tensor_model_parallel_size=2), True, False, "sequence_parallel=False"),
        (dict(tensor_model_parallel_size=2, sequence_parallel=True), False, False, "TE not detected"),
        (dict(tensor_model_parallel_size=2, sequence_parallel=True), True, True, None),
    ],
)
def test_tp_overlap_resolution(fake_versions, monkeypatch, caplog, overrides, have_te, expected, reason):
    monkeypatch.setattr(comm_overlap, "HAVE_TE", have_te)
    model = moe_model(**overrides)
    with caplog.at_level(logging.WARNING):
        CommOverlapConfig(
            tp_comm_overlap=True, tp_comm_overlap_cfg=userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192
        ).setup(model)
    assert model.tp_comm_overlap is expected
    if reason:
        # Upstream's wording, on the root logger: Bridge tooling matches on it.
        assert f"Disabling tensor parallel communication overlap due to {reason}." in caplog.text
    else:
        assert model.tp_comm_overlap_cfg["proj_fprop"]["num_splits"] == 4


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


def test_tp_overlap_cfg_is_written_as_a_dict_without_none(fake_versions, monkeypatch):
    monkeypatch.setattr(comm_overlap, "HAVE_TE", True)
    model = moe_model(tensor_model_parallel_size=2, sequence_parallel=True)
    overlap_cfg = {"qkv_dgrad": {"method": "bulk"}, "qkv_wgrad": None}
    CommOverlapConfig(tp_comm_overlap=True, tp_comm_overlap_cfg=overlap_cfg, tp_comm_bootstrap_backend="mpi").setup(
        model
    )
    assert model.tp_comm_overlap_cfg == {"qkv_dgrad": {"method": "bulk"}}
    assert model.tp_comm_bootstrap_backend == "mpi"


def test_bootstrap_backend_defaults_to_nccl_as_upstream(fake_versions, monkeypatch):
    monkeypatch.setattr(comm_overlap, "HAVE_TE", True)
    model = moe_model(tensor_model_parallel_size=2, sequence_parallel=True)
    CommOverlapConfig(tp_comm_overlap=True).setup(model)
    assert (model.tp_comm_overlap_cfg, model.tp_comm_bootstrap_backend) == (None, "nccl")


def test_lora_preset_leaves_wgrad_gemms_to_te():
    as_dict = dataclasses.asdict(userbuffers_fp8_h100_h16384_tp4_mbs1_seqlen2048_lora)
    assert as_dict["qkv_wgrad"] is None and as_dict["fc1_wgrad"] is None
    assert as_dict["fc1_dgrad"] == dict(
        num_sm=16, cga_size=2, num_splits=4, set_sm_margin=True, fp8_buf=True, atomic_gemm=False, method="pipeline"
    )
    assert as_dict["qkv_fprop"]["aggregate"] is True


def test_moe_rule_errors_are_caught_as_assertion_errors(fake_versions):
    """Code written against upstream caught AssertionError from the MoE checks; it still does, with all of them."""
    cfg = CommOverlapConfig(tp_comm_overlap=False, overlap_moe_expert_parallel_comm=True)
    cfg.finalize()
    model = moe_model(recompute_modules=["moe"], mtp_num_layers=2)
    with pytest.raises(AssertionError) as raised:
        cfg._get_model_comm_overlap_cfgs(model, DistributedDataParallelConfig())
    text = str(raised.value)
    assert "moe in recompute_modules" in text and "MTP supports at most one layer" in text
    assert isinstance(raised.value, ValueError)


@pytest.mark.parametrize(
    "field, value",
    [
        ("overlap_moe_expert_parallel_comm", "false"),
        ("delay_wgrad_compute", 1),
        ("bucket_size", "128M"),
        ("bucket_size", True),
        ("data_parallel_size", 2.0),
    ],
)
def test_wrong_types_are_refused_not_coerced(field, value):
    # bool("false") is True: a string here used to switch overlap on.
    cfg = CommOverlapConfig(tp_comm_overlap=False, **{field: value})
    with pytest.raises(CommOverlapConfigError) as raised:
        cfg.finalize()
    (violation,) = raised.value.violations
    assert violation.name == field
    assert f"comm_overlap.{field}={value!r}" in str(violation)


def test_every_wrong_type_is_listed_at_once():
    cfg = CommOverlapConfig(tp_comm_overlap="yes", overlap_p2p_comm="no", wgrad_deferral_limit="-1")
    with pytest.raises(CommOverlapConfigError) as raised:
        cfg.finalize()
    assert [v.name for v in raised.value.violations] == ["tp_comm_overlap", "overlap_p2p_comm", "wgrad_deferral_limit"]


def gpt_model_config(**transformer):
    """Megatron's GPTModelConfig: every TransformerConfig field is proxied to ``.transformer``."""
    settings = dict(num_layers=4, hidden_size=64, num_attention_heads=4, pipeline_dtype=torch.float32)
    settings.update(transformer)
    return GPTModelConfig(transformer=TransformerConfig(**settings), vocab_size=128)


def test_forwarded_fields_of_gpt_model_config_get_auto_values(fake_versions):
    model = gpt_model_config(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2)
    assert not is_explicitly_set(model, "overlap_p2p_comm")
    CommOverlapConfig(tp_comm_overlap=False).setup(model)
    assert (model.overlap_p2p_comm, model.batch_p2p_comm) == (True, False)


def test_forwarded_fields_raise_no_false_conflict(fake_versions):
    model = gpt_model_config()
    CommOverlapConfig(tp_comm_overlap=False, overlap_p2p_comm=True, data_parallel_size=4).setup(
        model, OptimizerConfig(), DistributedDataParallelConfig(use_distributed_optimizer=True)
    )
    assert model.overlap_p2p_comm is True


def test_forwarded_field_set_explicitly_still_counts(fake_versions):
    model = gpt_model_config(batch_p2p_comm=False)
    assert is_explicitly_set(model, "batch_p2p_comm")
    found = comm_overlap_violations(CommOverlapConfig(tp_comm_overlap=False, batch_p2p_comm=True), model)
    assert [v.name for v in found] == ["conflict"]


@dataclasses.dataclass(init=False)
class ProviderStandIn:
    """A recipe's provider stand-in (as upstream's Moonlight recipe test has): a dataclass declaring a few fields and
    holding the MoE flags as plain attributes at their Megatron-Core defaults."""

    pipeline_model_parallel_size: int = 1

    def __init__(self, **values):
        for key, value in {**moe_model().__dict__, **values}.items():
            setattr(self, key, value)
        self.overlap_moe_expert_parallel_comm = self.delay_wgrad_compute = False


def test_a_field_default_never_conflicts_with_comm_overlap(fake_versions):
    model = ProviderStandIn()
    assert not is_explicitly_set(model, "delay_wgrad_compute")  # not a field here: TransformerConfig's default
    CommOverlapConfig(tp_comm_overlap=False, overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True).setup(
        model
    )
    assert (model.overlap_moe_expert_parallel_comm, model.delay_wgrad_compute) == (True, True)


def test_an_explicit_contradiction_is_still_refused(fake_versions):
    requested = dict(tp_comm_overlap=False, overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)
    differs = ProviderStandIn()
    differs.overlap_moe_expert_parallel_comm = True  # differs from its default: set
    assert not comm_overlap_violations(CommOverlapConfig(**requested), differs)
    differs_from_request = moe_model(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)
    found = comm_overlap_violations(
        CommOverlapConfig(**{**requested, "delay_wgrad_compute": False}), differs_from_request
    )
    assert [v.name for v in found] == ["conflict"]
    # False equals the default; a recipe that means it says so, and the contradiction is refused.
    stated = moe_model(delay_wgrad_compute=False)
    mark_explicit(stated, "delay_wgrad_compute")
    found = comm_overlap_violations(CommOverlapConfig(**requested), stated)
    assert [v.name for v in found] == ["conflict"] and "delay_wgrad_compute=False" in str(found[0])
    unstated = moe_model(delay_wgrad_compute=False)
    assert not comm_overlap_violations(CommOverlapConfig(**requested), unstated)


def test_explicit_ddp_value_stands_when_comm_overlap_leaves_it_auto(fake_versions):
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True)
    CommOverlapConfig(tp_comm_overlap=False, data_parallel_size=1).setup(moe_model(), OptimizerConfig(), ddp)
    assert ddp.overlap_grad_reduce is True  # DP=1 would auto-resolve it off


def test_violations_function_leaves_the_users_request_untouched(fake_versions):
    cfg = CommOverlapConfig(tp_comm_overlap=True)
    comm_overlap_violations(cfg, moe_model())  # TP overlap is infeasible here (TP=1)
    cfg.finalize()
    assert cfg.user_comm_overlap_cfg.tp_comm_overlap is True


def test_the_plugin_entry_point_is_this_config_when_standalone(fake_versions):
    from megatron.bridge.training.ep_overlap_config import EPOverlapCommOverlapConfig

    with pytest.raises(CommOverlapConfigError) as raised:
        EPOverlapCommOverlapConfig(tp_comm_overlap=False, overlap_moe_expert_parallel_comm="yes").finalize()
    assert [v.name for v in raised.value.violations] == ["overlap_moe_expert_parallel_comm"]
    model = moe_model(expert_model_parallel_size=1, moe_token_dispatcher_type="allgather", bf16=False)
    cfg = EPOverlapCommOverlapConfig(tp_comm_overlap=False, overlap_moe_expert_parallel_comm=True)
    with pytest.raises(CommOverlapConfigError) as raised:
        cfg.setup(model)
    assert [v.name for v in raised.value.violations] == ["expert_parallel", "token_dispatcher", "precision"]
    good = moe_model()
    EPOverlapCommOverlapConfig(tp_comm_overlap=False, overlap_moe_expert_parallel_comm=True).setup(good)
    assert good.overlap_moe_expert_parallel_comm is True


class DeferringProvider(ProviderStandIn):
    """A Megatron-Bridge model provider's order: the recipe's setup writes the config, then ``finalize()`` runs
    Megatron-Core's own checks (``TransformerConfig.__post_init__``) on what setup wrote."""

    def finalize(self):
        names = [f.name for f in dataclasses.fields(TransformerConfig) if f.init and hasattr(self, f.name)]
        TransformerConfig(**{name: getattr(self, name) for name in names})


@pytest.mark.parametrize("config_class", [CommOverlapConfig, "EPOverlapCommOverlapConfig"])
def test_the_plain_1f1b_pipeline_gets_the_overlap_flag_once_the_config_is_built(fake_versions, config_class):
    from megatron.bridge.training.ep_overlap.mcore import use_ep_overlap_schedule
    from megatron.bridge.training.ep_overlap.settings import DEFERRED, apply_deferred
    from megatron.bridge.training.ep_overlap_config import EPOverlapCommOverlapConfig

    config_class = EPOverlapCommOverlapConfig if config_class == "EPOverlapCommOverlapConfig" else config_class
    requested = dict(tp_comm_overlap=False, overlap_moe_expert_parallel_comm=True, batch_p2p_comm=False)
    provider = DeferringProvider(pipeline_model_parallel_size=2, _pre_wrap_hooks=[use_ep_overlap_schedule])
    config_class(**requested).setup(provider)
    assert provider.overlap_moe_expert_parallel_comm is False and getattr(provider, DEFERRED)
    provider.finalize()  # Megatron-Core's checks pass: the flag is not on the config they see
    provider.overlap_moe_expert_parallel_comm = True
    with pytest.raises(AssertionError, match="virtual_pipeline_model_parallel_size"):
        provider.finalize()  # what they would say of it
    provider.overlap_moe_expert_parallel_comm = False
    assert apply_deferred(provider) == {"overlap_moe_expert_parallel_comm": True}
    assert provider.overlap_moe_expert_parallel_comm is True and getattr(provider, DEFERRED) is None

    # Megatron-Core's own schedule does not pair this pipeline: the rule refuses, naming both fixes.
    unhooked = DeferringProvider(pipeline_model_parallel_size=2)
    with pytest.raises(CommOverlapConfigError, match=r"\[pipeline_needs_vpp\].*use_ep_overlap_schedule"):
        config_class(**requested).setup(unhooked)
    # Delayed wgrad needs the overlap flag, so it is deferred with it: both pass Megatron-Core's checks, and both are
    # set before the build (the patched setup) or on the built config (the hook, which warns that nothing is delayed).
    delayed = DeferringProvider(pipeline_model_parallel_size=2, _pre_wrap_hooks=[use_ep_overlap_schedule])
    config_class(**requested, delay_wgrad_compute=True).setup(delayed)
    assert not delayed.overlap_moe_expert_parallel_comm and not delayed.delay_wgrad_compute
    delayed.finalize()
    both = {"overlap_moe_expert_parallel_comm": True, "delay_wgrad_compute": True}
    assert apply_deferred(delayed) == both and delayed.delay_wgrad_compute is True
    # A built config (no finalize to come) keeps the flag as written.
    built = moe_model(pipeline_model_parallel_size=2)
    built.ep_overlap_schedule = "bridge"
    config_class(**requested).setup(built)
    assert built.overlap_moe_expert_parallel_comm is True and getattr(built, DEFERRED, None) is None


def test_bridges_loop_must_take_our_function_for_the_plain_1f1b_pipeline(monkeypatch):
    import sys

    from megatron.core.pipeline_parallel import schedules

    from megatron.bridge.training.ep_overlap.mcore import get_forward_backward_func
    from megatron.bridge.training.ep_overlap.mcore.forward_backward import unpaired_loop_problem

    config = SimpleNamespace(
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=None,
        overlap_moe_expert_parallel_comm=True,
    )
    loop = SimpleNamespace(get_forward_backward_func=schedules.get_forward_backward_func)  # unpatched train.py
    monkeypatch.setitem(sys.modules, "megatron.bridge.training.train", loop)
    problem = unpaired_loop_problem(config)
    assert "train() (unpatched)" in problem and "fix: apply this project's patch (tools/upstream.py patch)" in problem
    loop.get_forward_backward_func = get_forward_backward_func  # patched
    assert unpaired_loop_problem(config) is None
    loop.get_forward_backward_func = schedules.get_forward_backward_func
    for layout in ({"virtual_pipeline_model_parallel_size": 2}, {"pipeline_model_parallel_size": 1}):
        assert unpaired_loop_problem(SimpleNamespace(**{**vars(config), **layout})) is None
    monkeypatch.delitem(sys.modules, "megatron.bridge.training.train")  # another loop: it takes ours itself
    assert unpaired_loop_problem(config) is None
    # Megatron-Core's schedule everywhere but the plain 1F1B pipeline (its microbatch count announced).
    assert get_forward_backward_func(pp_size=1).schedule is schedules.get_forward_backward_func(pp_size=1)
    assert (
        get_forward_backward_func(pp_size=2, vp_size=2).schedule
        is schedules.forward_backward_pipelining_with_interleaving
    )
    assert get_forward_backward_func(pp_size=2).__name__ == "forward_backward_pipelining_with_ep_overlap"
