"""Pipeline parallelism: the schedule as data, its deadlock freedom, and bitwise numerics across layouts.

The numerics matrix trains the same model (weights keyed by global layer number) as one PP = 1 run on 2 ranks
(EP 2) and as PP 2 x VPP 2 x EP 2 runs on 4 ranks, plain, overlapped, and overlapped with delayed wgrad; and as the
plain 1F1B pipeline (PP 2 and PP 4, no virtual stages; 1F1B plain, paired with the overlap). Every loss, every
gradient and every parameter after 3 Adam steps must match the PP = 1 run bit for bit.
"""

import itertools
import time
from dataclasses import dataclass, replace
from datetime import timedelta

import pytest
import torch

from ep_overlap_lab.engine import EPOverlapEngine
from ep_overlap_lab.moe_gpt import MoEGPTConfig, MoEGPTModel, build_pipeline_chunks
from ep_overlap_lab.pipeline_layout import chunk_layers, chunk_layers_of
from ep_overlap_lab.program.pipeline import pipeline_schedule, simulate, virtual_order, warmup_count
from megatron.bridge.training.ep_overlap.program.pipeline import Phase

from .bitwise import assert_bitwise
from .local_ranks import init_ep_groups, run_local_ranks, single_process_groups
from .test_numerics import EXPERT_BIAS
from .workers import Case, batches

# ---- the schedule as data ---------------------------------------------------------------------------------


def test_pp1_is_the_engines_microbatch_order():
    for n in (1, 2, 5):
        steps = pipeline_schedule(1, 1, n, 0, overlap=True)
        assert [(s.phase, s.forward, s.backward) for s in steps] == [
            ("warmup", (0, 0), None),
            *(("paired", (i + 1, 0), (i, 0)) for i in range(n - 1)),
            ("cooldown", None, (n - 1, 0)),
        ]
        assert all(not s.recv and not s.send for s in steps)


def test_warmup_is_megatrons_count_plus_one_with_overlap():
    for P, V, r in itertools.product((2, 4), (2, 3), range(4)):
        if r >= P:
            continue
        megatron = 2 * (P - r - 1) + (V - 1) * P
        assert warmup_count(P, V, 4 * P, r, overlap=False) == megatron
        assert warmup_count(P, V, 4 * P, r, overlap=True) == megatron + 1


def test_without_the_extra_warmup_the_last_stage_would_pair_a_microbatch_with_itself():
    P, V, N = 2, 2, 4
    forwards = virtual_order(N, P, V)
    first_backward = (forwards[0][0], V - 1 - forwards[0][1])
    assert forwards[warmup_count(P, V, N, P - 1, overlap=False)] == first_backward  # same microbatch, same chunk
    paired = [s for s in pipeline_schedule(P, V, N, P - 1, overlap=True) if s.paired]
    assert paired and all(s.forward != s.backward for s in paired)


@pytest.mark.parametrize("overlap", [True, False])
def test_no_layout_deadlocks(overlap):
    # Every rank's list against the others': N below, at and above PP, N not a multiple of PP, V from 1 to 4.
    for P, V, N in itertools.product(range(1, 6), range(1, 5), range(1, 18)):
        simulate(P, V, N, overlap=overlap)


def test_every_transfer_is_sent_once_and_received_once():
    for P, V, N in ((2, 2, 5), (3, 2, 4), (4, 3, 9)):
        sent, received = [], []
        for r in range(P):
            for s in pipeline_schedule(P, V, N, r, overlap=True):
                sent += [(t.kind, t.microbatch, t.chunk, r, t.peer) for t in s.send]
                received += [(t.kind, t.microbatch, t.chunk, t.peer, r) for t in s.recv]
        assert sorted(sent) == sorted(received) and len(set(sent)) == len(sent)
        # 2 (N) (P V - 1): an activation and a gradient across each chunk boundary, per microbatch
        assert len(sent) == 2 * N * (P * V - 1)


def test_chunk_layers_follow_megatron_core():
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    for n, P, V, first, last in ((8, 2, 2, None, None), (12, 3, 2, 2, 2), (10, 3, 2, 2, None), (9, 3, 1, 1, 2)):
        config = replace(
            PipeCase(layer_freq=(1,) * n).config(P, V),
            num_layers_in_first_pipeline_stage=first,
            num_layers_in_last_pipeline_stage=last,
            virtual_pipeline_model_parallel_size=V if V > 1 else None,
        )
        offsets = [
            get_transformer_layer_offset(config, vp_stage=v if V > 1 else None, pp_rank=r)
            for v in range(V)
            for r in range(P)
        ]
        assert [layers[0] for layers in chunk_layers_of(config)] == offsets
    # Megatron-Core's offset function divides by zero when no stage is in the middle; the split is still this:
    assert chunk_layers(6, 2, 2, first_stage=2, last_stage=4) == [[0], [1, 2], [3], [4, 5]]
    with pytest.raises(ValueError, match="not divisible by virtual_pipeline_model_parallel_size=2"):
        chunk_layers(6, 2, 2, first_stage=3, last_stage=3)
    with pytest.raises(ValueError, match="do not divide over 2 stages"):
        chunk_layers(7, 4, 1, first_stage=1, last_stage=1)


def test_the_same_model_exists_under_every_layout():
    groups = replace(single_process_groups(), ep_size=2)  # EP rank 0's half of the experts; no process group needed
    whole = dict(MoEGPTModel(PipeCase().config(1, 1), groups, seed=7).global_named_parameters())
    pieces = {}
    for rank in range(2):
        for chunk in build_pipeline_chunks(PipeCase().config(2, 2), groups, 7, rank):
            pieces.update(chunk.global_named_parameters())
    assert pieces.keys() == whole.keys()
    for name, param in whole.items():
        assert torch.equal(param, pieces[name]), name


# ---- numerics across layouts ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PipeCase(Case):
    layer_freq: tuple = (1, 0, 1, 1)
    microbatches: int = 2
    first_stage: int | None = None
    last_stage: int | None = None
    custom_chunks: tuple | None = None  # global layers per chunk id instead of Megatron-Core's split of the config

    def config(self, pp: int = 1, vpp: int = 1) -> MoEGPTConfig:
        base = super().config()
        return replace(
            base,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp if pp > 1 and vpp > 1 else None,
            num_layers_in_first_pipeline_stage=self.first_stage if pp > 1 else None,
            num_layers_in_last_pipeline_stage=self.last_stage if pp > 1 else None,
            pipeline_dtype=base.activation_dtype() if pp > 1 else None,
        )


def build_chunks(case: PipeCase, config, groups, pp: int):
    if pp == 1:
        return MoEGPTModel(config, groups, seed=7)
    if case.custom_chunks is None:
        return build_pipeline_chunks(config, groups, 7, groups.pp_rank)
    last = len(case.custom_chunks) - 1
    return [
        MoEGPTModel(config, groups, 7, layer_numbers=list(case.custom_chunks[c]), pre_process=c == 0,
                    post_process=c == last)
        for c in range(groups.pp_rank, len(case.custom_chunks), pp)
    ]  # fmt: skip


def train_layout(rank: int, world: int, case: PipeCase, pp: int, vpp: int, arms: tuple) -> dict:
    groups = init_ep_groups(case.ep, timedelta(seconds=case.timeout_s), pipeline_size=pp)
    config = case.config(pp, vpp)
    data_rank = rank % (world // pp)  # the ranks of a stage hold different data; the stages of a pipeline the same
    out = {"data_rank": data_rank}
    for arm in arms:
        model = build_chunks(case, config, groups, pp)
        chunks = model if isinstance(model, list) else [model]
        engine = EPOverlapEngine(model, groups, overlap=arm != "plain", delay_wgrad=arm == "delayed")
        optimizer = torch.optim.Adam([p for c in chunks for p in c.parameters()], lr=1e-2)
        named = [item for c in chunks for item in c.global_named_parameters()]
        out[arm] = train_recording(engine, optimizer, named, [batches(case, data_rank, s) for s in range(case.steps)])
        out[arm]["biases"] = {
            number: layer.expert_bias_E.clone()
            for chunk in chunks
            for number, layer in zip(chunk.layer_numbers, chunk.layers)
            if getattr(layer, "expert_bias_E", None) is not None
        }
    return out


def train_recording(engine, optimizer, named: list, data_per_step: list) -> dict:
    """Steps of training; per step the losses (None off the last stage) and every gradient by ``named``'s names,
    then the final parameters."""
    losses, grads, phases = [], [], set()
    for data in data_per_step:
        result = engine.step(data)
        losses.append(torch.stack(result.losses) if result.losses else None)
        grads.append({name: p.grad.clone() for name, p in named})
        phases |= {str(record.phase) for record in result.recorder.comm}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    params = {n: p.detach().clone() for n, p in named}
    return {"losses": losses, "grads": grads, "params": params, "phases": phases}


PIPELINE_ARMS = ("plain", "overlap", "delayed")


def assert_matches_reference(ref: dict, run: dict, steps: int, where: str) -> None:
    """A pipelined run's losses (last stage only), gradients and final parameters against the PP = 1 run's, by
    global parameter name, bit for bit."""
    for step in range(steps):
        if run["losses"][step] is not None:
            assert_bitwise(ref["losses"][step], run["losses"][step], f"{where} step {step} losses")
        for param, grad in run["grads"][step].items():
            assert_bitwise(ref["grads"][step][param], grad, f"{where} step {step} grad {param}")
    for param, value in run["params"].items():
        assert_bitwise(ref["params"][param], value, f"{where} param {param} after {steps} steps")
    for layer, bias in run.get("biases", {}).items():  # summed over the stage's replicas, as PP = 1 sums them
        assert_bitwise(ref["biases"][layer], bias, f"{where} expert bias of layer {layer} after {steps} steps")


PIPE_CASES = {
    "pp2-vpp2-ep2-N2": PipeCase(microbatches=2),
    "pp2-vpp2-ep2-N5": PipeCase(microbatches=5),
    "pp2-vpp2-ep2-bf16-N4": PipeCase(bf16=True, microbatches=4),
    # Uneven stages (1 layer per chunk on stage 0, 2 on stage 1), stage 0 only dense, an odd number of MoE layers
    # in the last chunk; N = 3 is not a multiple of PP.
    "pp2-vpp2-uneven-dense-stage-N3": PipeCase(
        layer_freq=(0, 1, 1, 0, 1, 0), first_stage=2, last_stage=4, microbatches=3
    ),
    # Router expert biases move after every step from token counts summed over each stage's replicas.
    "pp2-vpp2-ep2-expert-bias-N4": PipeCase(microbatches=4, extra=EXPERT_BIAS),
    # Chunks of different lengths on one rank: paired steps run the longer chunk's extra layers unpaired.
    "pp2-vpp2-unequal-chunks-N4": PipeCase(
        layer_freq=(1, 1, 0, 1, 1, 0),
        first_stage=2,
        last_stage=4,
        custom_chunks=((0,), (1, 2), (3, 4), (5,)),
        microbatches=4,
    ),
}


def assert_layout_matches_pp1(case: PipeCase, pp: int, vpp: int) -> set[str]:
    """Every arm of a PP x VPP x EP 2 run against the PP = 1 plain run of the same model, bit for bit. Returns the
    phases the overlapped arm's all-to-alls ran in, over every rank."""
    reference = {
        o.result["data_rank"]: o.result["plain"] for o in run_local_ranks(train_layout, 2, (case, 1, 1, ("plain",)))
    }
    outcomes = run_local_ranks(train_layout, 2 * pp, (case, pp, vpp, PIPELINE_ARMS))
    seen, biased, phases = set(), set(), set()
    for outcome in outcomes:
        ref = reference[outcome.result["data_rank"]]
        for arm in PIPELINE_ARMS:
            assert_matches_reference(ref, outcome.result[arm], case.steps, f"rank {outcome.rank} {arm}")
            seen.update(outcome.result[arm]["params"])
            biased.update(outcome.result[arm]["biases"])
        assert Phase.PAIRED not in outcome.result["plain"]["phases"]
        phases |= outcome.result["overlap"]["phases"]
    assert seen == set(reference[0]["params"])  # the pipeline holds the whole model
    assert biased == set(reference[0]["biases"])  # and compared every router's bias
    assert all(bias.abs().sum() > 0 for bias in reference[0]["biases"].values())  # which moved
    return phases


@pytest.mark.parametrize("name", sorted(PIPE_CASES))
def test_pipelined_runs_are_bitwise_equal_to_pp1_plain(name):
    assert Phase.PAIRED in assert_layout_matches_pp1(PIPE_CASES[name], 2, 2)


# The plain 1F1B pipeline (no virtual stages): 1F1B with the overlap off, paired steps with it on.
PLAIN_1F1B_CASES = {
    "pp2-ep2-N3": (PipeCase(microbatches=3), 2),
    "pp2-ep2-N1": (PipeCase(microbatches=1), 2),
    "pp2-uneven-expert-bias-N4": (PipeCase(layer_freq=(0, 1, 1), first_stage=1, microbatches=4, extra=EXPERT_BIAS), 2),
    "pp4-ep2-N9": (PipeCase(microbatches=9), 4),
}


@pytest.mark.parametrize("name", sorted(PLAIN_1F1B_CASES))
def test_plain_1f1b_pipeline_runs_are_bitwise_equal_to_pp1_plain(name):
    case, pp = PLAIN_1F1B_CASES[name]
    phases = assert_layout_matches_pp1(case, pp, 1)
    assert (Phase.PAIRED in phases) is (case.microbatches > 1)  # one microbatch has nothing to pair with


# ---- failures and evaluation ------------------------------------------------------------------------------


def _pipeline_fails_mid_step(rank: int, world: int, failing_rank: int, overlap: bool, mode: str = "raise") -> str:
    case = PipeCase(microbatches=4, timeout_s=2.0)
    groups = init_ep_groups(case.ep, timedelta(seconds=case.timeout_s), pipeline_size=2)
    chunks = build_pipeline_chunks(case.config(2, 2), groups, 7, groups.pp_rank)
    engine = EPOverlapEngine(chunks, groups, overlap=overlap)
    engine.step(batches(case, rank % 2, 0))  # one good step first
    if rank == failing_rank:
        layer = chunks[1].layers[0]
        original = layer.experts

        def broken(*args):
            if broken.calls == 2 and mode == "raise":
                raise RuntimeError(f"injected failure in {layer.name} experts")
            if broken.calls == 2:
                time.sleep(8)  # stall past the peers' timeout
            broken.calls += 1
            return original(*args)

        broken.calls = 0
        layer.experts = broken
    engine.step(batches(case, rank % 2, 1))
    return "finished"


@pytest.mark.parametrize(
    "failing_rank, overlap, mode", [(1, True, "raise"), (1, False, "raise"), (2, True, "raise"), (2, False, "raise"),
                                    (2, True, "stall")]
)  # fmt: skip
def test_a_pipeline_rank_that_raises_or_stalls_stops_every_other_rank(failing_rank, overlap, mode):
    start = time.monotonic()
    outcomes = run_local_ranks(_pipeline_fails_mid_step, 4, (failing_rank, overlap, mode), raise_on_error=False)
    elapsed = time.monotonic() - start
    if mode == "raise":
        assert "injected failure in layer" in outcomes[failing_rank].error
    for outcome in outcomes:
        if outcome.rank == failing_rank:
            continue
        assert outcome.error is not None, f"rank {outcome.rank} finished a step whose peer failed"
        line = outcome.error.split(f"CollectiveError: rank {outcome.rank}: ")[1].splitlines()[0]
        assert "did not complete" in line and ("pipeline" in line or "layer" in line), line
    assert elapsed < 40


def _evaluate(rank: int, world: int) -> dict:
    case = PipeCase(microbatches=3)
    groups = init_ep_groups(case.ep, timedelta(seconds=case.timeout_s), pipeline_size=2)
    chunks = build_pipeline_chunks(case.config(2, 2), groups, 7, groups.pp_rank)
    engine = EPOverlapEngine(chunks, groups, overlap=True)
    data = batches(case, rank % 2, 0)
    evaluated = engine.step(data, forward_only=True).losses
    no_grads = all(p.grad is None for c in chunks for p in c.parameters())
    return {"evaluated": evaluated, "trained": engine.step(data).losses, "no_grads": no_grads}


def test_forward_only_runs_the_pipeline_and_matches_training_losses():
    outcomes = run_local_ranks(_evaluate, 4)
    for outcome in outcomes:
        result = outcome.result
        assert result["no_grads"]
        last_stage = outcome.rank >= 2
        assert len(result["evaluated"]) == (3 if last_stage else 0) == len(result["trained"])
        for a, b in zip(result["evaluated"], result["trained"]):
            assert_bitwise(a, b, f"rank {outcome.rank} loss")
