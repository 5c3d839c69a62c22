"""What Megatron-Core's plan trains and ours once did not: experts' inputs padded to capacity run bitwise;
Megatron-FSDP runs at PP 1 (test_megatron_fsdp) and with a pipeline is refused by name at setup, with the fix."""

import pytest

from .bitwise import assert_arms_match_plain
from .local_ranks import run_local_ranks
from .mcore_arms import run_arm
from .mcore_cpu import init_megatron, install_cpu_stubs
from .mcore_models import McoreCase

PADDED = McoreCase(
    microbatches=3,
    config=(("moe_expert_capacity_factor", 1.0), ("moe_pad_expert_input_to_capacity", True)),
)


def _padded(rank: int, world: int) -> dict:
    install_cpu_stubs()
    init_megatron(world)
    out = {}
    for arm in ("plain", "mcore", "hook"):
        result = run_arm(arm, PADDED)
        out[arm] = {"losses": result["losses"], "grads": result["grads"]}
    return out


def test_experts_padded_to_capacity_train_bitwise():
    for outcome in run_local_ranks(_padded, PADDED.world):
        assert_arms_match_plain(outcome.result, outcome.rank)


@pytest.mark.parametrize("bridge_checks", [True, False], ids=["in-tree", "plugin"])
def test_megatron_fsdp_with_a_pipeline_is_refused_by_name_at_setup(fake_versions, monkeypatch, bridge_checks):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from megatron.bridge.training.comm_overlap import CommOverlapConfig, CommOverlapConfigError
    from megatron.bridge.training.ep_overlap_config import EPOverlapCommOverlapConfig
    from megatron.bridge.training.moe_overlap_rules import use_bridge_schedule

    from .test_comm_overlap_rules import moe_model

    # in-tree, CommOverlapConfig runs the rules itself; the plugin's config runs them on any Megatron-Bridge
    monkeypatch.setattr(CommOverlapConfig, "checks_ep_overlap_rules", bridge_checks)

    def setup(fsdp: bool, pipeline: int = 2):
        model = use_bridge_schedule(moe_model(pipeline_model_parallel_size=pipeline))
        ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, use_megatron_fsdp=fsdp)
        EPOverlapCommOverlapConfig(tp_comm_overlap=False, overlap_moe_expert_parallel_comm=True).setup(
            model, OptimizerConfig(), ddp
        )

    setup(False)
    setup(True, pipeline=1)
    with pytest.raises(CommOverlapConfigError) as raised:
        setup(True)
    lines = [line for line in str(raised.value).splitlines() if "use_megatron_fsdp" in line]
    assert len(lines) == 1 and "Fix: " in lines[0] and "use_megatron_fsdp=False" in lines[0], str(raised.value)
