"""Bad input gets a clear error naming the layer; a failing or stalled rank never leaves its peers hanging."""

import time
from datetime import timedelta

import pytest
import torch

from ep_overlap_lab.engine import EPOverlapEngine
from ep_overlap_lab.moe_gpt import MoEGPTModel
from megatron.bridge.training.comm_overlap import CommOverlapConfig, CommOverlapConfigError

from .local_ranks import init_ep_groups, run_local_ranks, single_process_groups
from .workers import Case, batches


def _fail_mid_step(rank: int, world: int, mode: str, overlap: bool) -> str:
    case = Case(layer_freq=(1, 1), microbatches=2)
    groups = init_ep_groups(2, timedelta(seconds=2))
    model = MoEGPTModel(case.config(), groups)
    engine = EPOverlapEngine(model, groups, overlap=overlap)
    engine.step(batches(case, rank, 0))  # one good step first
    if rank == 1:
        layer = model.layers[1]
        original = layer.experts

        def broken(*args):
            if mode == "raise":
                raise RuntimeError("injected failure in layer1 experts")
            time.sleep(6)  # stall past the peers' timeout
            return original(*args)

        layer.experts = broken
    engine.step(batches(case, rank, 1))
    return "finished"


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("mode", ["raise", "stall"])
def test_peer_failure_raises_naming_rank_and_op(mode, overlap):
    start = time.monotonic()
    outcomes = run_local_ranks(_fail_mid_step, 2, (mode, overlap), raise_on_error=False)
    elapsed = time.monotonic() - start
    survivor = outcomes[0]
    assert survivor.error is not None, "rank 0 finished a step whose peer failed"
    assert "CollectiveError: rank 0:" in survivor.error
    assert "layer" in survivor.error.split("CollectiveError: rank 0:")[1].splitlines()[0]
    if mode == "raise":
        assert "injected failure in layer1 experts" in outcomes[1].error
    assert elapsed < 30


def test_engine_rejects_what_the_rules_reject():
    # Full recompute of no layer, with dropout, set after the model was built (the reference model itself refuses
    # both when built).
    layer_recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 0}
    layer_recompute["hidden_dropout"] = 0.1
    config = Case(world=1, ep=1).config()
    model = MoEGPTModel(config)
    for key, value in layer_recompute.items():
        setattr(config, key, value)
    with pytest.raises(CommOverlapConfigError) as raised:
        EPOverlapEngine(model, single_process_groups(), overlap=True)
    names = {v.name for v in raised.value.violations}
    assert {"expert_parallel", "full_recompute_num_layers", "full_recompute_dropout"} <= names
    # The same config through CommOverlapConfig.setup fails with the same rules.
    with pytest.raises(CommOverlapConfigError) as again:
        CommOverlapConfig(tp_comm_overlap=False, overlap_moe_expert_parallel_comm=True).setup(config)
    assert {v.name for v in again.value.violations} == names


def test_engine_reads_flags_from_the_model_config():
    model = MoEGPTModel(Case(world=1, ep=1).config())
    model.config.delay_wgrad_compute = True
    with pytest.raises(CommOverlapConfigError, match="delay_wgrad_needs_overlap"):
        EPOverlapEngine.from_config(model, single_process_groups())


def test_wrong_sequence_length_is_refused_up_front_and_by_the_embedding():
    case = Case(world=1, ep=1)
    model = MoEGPTModel(case.config())
    engine = EPOverlapEngine(model, single_process_groups(), overlap=False)
    tokens = torch.zeros(2, case.seq_length + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="microbatch 0: sequences of 9 tokens, but the model takes 8"):
        engine.step([(tokens, tokens)])
    with pytest.raises(ValueError, match="embedding: got sequences of length 9"):
        model.embed(tokens)


def test_wrong_hidden_size_names_the_layer():
    model = MoEGPTModel(Case(world=1, ep=1).config())
    with pytest.raises(ValueError, match=r"layer1: expected hidden states \[tokens, 32\], got \(16, 8\)"):
        model.layers[1].pre_dispatch(torch.zeros(16, 8))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"moe_token_dispatcher_type": "flex"}, "implements the alltoall token dispatcher only"),
        ({"add_bias_linear": True}, "has no biases"),
        ({"moe_layer_freq": [1, 0]}, "moe_layer_freq has 2 entries but num_layers=3"),
        # Features it does not have are refused, not ignored:
        ({"mtp_num_layers": 1}, "mtp_num_layers=1: the reference MoE GPT has no multi-token prediction layers"),
        ({"hybrid_layer_pattern": "*E"}, "hybrid_layer_pattern='\\*E': the reference MoE GPT is not a hybrid model"),
        ({"recompute_granularity": "full"}, "recompute_method=None: full recompute replays 'uniform' segments"),
        ({"recompute_method": "uniform"}, "recompute_method='uniform': a recompute method chooses the layers of full"),
        ({"recompute_granularity": "all"}, "recompute_granularity='all': the reference MoE GPT recomputes selected"),
    ],
)
def test_unsupported_layer_config_is_a_clear_error(overrides, message):
    config = Case(world=1, ep=1).config()
    for key, value in overrides.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=message):
        MoEGPTModel(config)


def test_ep_size_must_match_the_groups():
    with pytest.raises(ValueError, match="expert_model_parallel_size=2 but the EP group has 1 ranks"):
        MoEGPTModel(Case().config())


def test_forward_only_matches_training_losses_and_queues_nothing():
    case = Case(world=1, ep=1, layer_freq=(1, 0))
    model = MoEGPTModel(case.config())
    data = batches(case, 0, 0)
    engine = EPOverlapEngine(model, single_process_groups(), overlap=False)
    evaluated = engine.step(data, forward_only=True).losses
    assert all(p.grad is None for p in model.parameters())
    trained = engine.step(data).losses
    assert all(torch.equal(a, b) for a, b in zip(evaluated, trained))
