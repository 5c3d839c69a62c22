"""More than one multi-token prediction layer under this project's schedule (Megatron-Core's own stops at one).

The plan's head calls Megatron-Core's MTP block whole, which runs every depth in turn, so two MTP layers must give
the plain path's losses and gradients bitwise, under Megatron-Core's drivers at PP 1 and at PP 2 x VPP 2. A Bridge
provider gets the overlap flag once Megatron-Core's checks (which assert MTP <= 1 with it) have run.
``-m wide`` runs the bigger cases (HybridModel depths, the interleaved pipeline).
"""

import pytest

from .bitwise import assert_steps_bitwise
from .local_ranks import run_local_ranks
from .mcore_models import HybridCase, McoreCase
from .test_comm_overlap_rules import DeferringProvider
from .test_mcore_hook import train_interleaved, train_with_mcore_driver

wider = pytest.mark.wide
TWO_MTP = (("mtp_num_layers", 2),)


def _mtp_depths_trained(grads: dict) -> set[str]:
    """The MTP depths whose every weight got a nonzero gradient in the plain arm (both must train)."""
    depths = {}
    for name, grad in grads.items():
        if ".mtp.layers." in f".{name}":
            depth = name.split("mtp.layers.")[1].split(".")[0]
            depths.setdefault(depth, []).append(bool(grad.abs().sum() > 0))
    return {depth for depth, nonzero in depths.items() if all(nonzero)}


def test_two_mtp_layers_train_bitwise_under_megatron_cores_driver():
    case = McoreCase(mtp=True, microbatches=3, config=TWO_MTP)
    for outcome in run_local_ranks(train_with_mcore_driver, case.world, (case,)):
        plain, overlap = outcome.result["plain"], outcome.result["overlap"]
        assert_steps_bitwise(plain, overlap, case.steps, outcome.rank)
        assert _mtp_depths_trained(plain["grads"][-1]) == {"0", "1"}
        assert overlap["phases"][-1] == sorted([("warmup", 0), ("paired", 1), ("paired", 2)])


@wider
def test_hybrid_mtp_depths_train_bitwise_under_megatron_cores_driver():
    case = HybridCase(pattern="*E*E/*E/*E", microbatches=3)
    for outcome in run_local_ranks(train_with_mcore_driver, case.world, (case,)):
        plain, overlap = outcome.result["plain"], outcome.result["overlap"]
        assert_steps_bitwise(plain, overlap, case.steps, outcome.rank)
        assert _mtp_depths_trained(plain["grads"][-1]) == {"0", "1"}


INTERLEAVED = {
    "gpt-two-mtp-rope": McoreCase(
        layer_freq=(1, 0, 1, 1), microbatches=4, steps=2, mtp=True, rope=True, config=TWO_MTP
    ),
    "hybrid-two-mtp-depths": HybridCase(pattern="*E|E-|*-E|E*/*E/*E", microbatches=4, steps=2, rope=True),
}


@wider
@pytest.mark.parametrize("model", sorted(INTERLEAVED))
def test_two_mtp_layers_train_bitwise_in_the_interleaved_pipeline(model):
    case = INTERLEAVED[model]
    for outcome in run_local_ranks(train_interleaved, 4, (case, True)):
        plain, overlap = outcome.result["plain"], outcome.result["overlap"]
        assert_steps_bitwise(plain, overlap, case.steps, outcome.rank)
        assert "paired" in overlap["phases"]
        if outcome.rank >= 2:  # the last stage holds the MTP layers in its last chunk
            assert {n.split(".")[0] for n in plain["grads"][-1] if ".mtp.layers.1." in n} == {"chunk1"}


def test_a_provider_with_two_mtp_layers_gets_the_flag_after_megatron_cores_checks(fake_versions):
    from megatron.bridge.training.comm_overlap import CommOverlapConfig, CommOverlapConfigError
    from megatron.bridge.training.ep_overlap.mcore import use_ep_overlap_schedule
    from megatron.bridge.training.ep_overlap.mcore.refusals import config_refusals
    from megatron.bridge.training.ep_overlap.settings import apply_deferred

    requested = dict(tp_comm_overlap=False, overlap_moe_expert_parallel_comm=True)
    provider = DeferringProvider(mtp_num_layers=2, _pre_wrap_hooks=[use_ep_overlap_schedule])
    CommOverlapConfig(**requested).setup(provider)
    assert provider.overlap_moe_expert_parallel_comm is False
    provider.finalize()  # Megatron-Core's checks pass: the flag is not on the config they see
    assert apply_deferred(provider) == {"overlap_moe_expert_parallel_comm": True}
    assert config_refusals(provider) == []
    # Megatron-Core's own schedule runs one MTP layer at most: the rule refuses it there, naming both fixes.
    with pytest.raises(CommOverlapConfigError, match=r"\[mtp_layers\].*use_ep_overlap_schedule"):
        CommOverlapConfig(**requested).setup(DeferringProvider(mtp_num_layers=2))


class _Deferring:
    """A linear that deferred one weight gradient per forward use; ``backward_dw`` runs one (Transformer Engine's)."""

    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def backward_dw(self) -> None:
        self.calls.append(self.name)


@pytest.mark.parametrize("repeated", [True, False])
def test_the_mtp_blocks_delayed_wgrads_run_once_per_forward_use(repeated):
    from types import SimpleNamespace

    from megatron.bridge.training.ep_overlap.mcore.layer import mtp_backward_dw

    calls = []
    config = SimpleNamespace(mtp_num_layers=2, cuda_graph_impl="none", cuda_graph_modules=[])

    def depth(i: int):
        attention, mlp = _Deferring(f"attention{i}", calls), _Deferring(f"mlp{i}", calls)
        layer = SimpleNamespace(config=config, training=True, is_moe_layer=False, self_attention=attention, mlp=mlp)
        return SimpleNamespace(eh_proj=_Deferring(f"eh_proj{i}", calls), mtp_model_layer=layer)

    # One MTP layer run for both depths (mtp_use_repeated_layer), or a layer per depth.
    depths = [depth(0)] if repeated else [depth(0), depth(1)]
    mtp_backward_dw(SimpleNamespace(config=config, mtp_use_repeated_layer=repeated, layers=depths), microbatch=0)
    per_use = [[f"eh_proj{i}", f"attention{i}", f"mlp{i}"] for i in ((0, 0) if repeated else (0, 1))]
    assert calls == [name for use in per_use for name in use]
