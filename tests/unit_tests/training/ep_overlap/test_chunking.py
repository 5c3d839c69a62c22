"""Chunked unpaired phases (``moe_ep_overlap_chunks=2``): what is split, what it equals exactly, how far it is from
the unchunked plain path, and what is refused."""

from datetime import timedelta
from types import SimpleNamespace

import pytest

from ep_overlap_lab.engine import EPOverlapEngine
from ep_overlap_lab.moe_gpt import MoEGPTModel
from ep_overlap_lab.program.units import Unit, units
from megatron.bridge.training.ep_overlap import EPOverlapOptions
from megatron.bridge.training.ep_overlap.settings import resolve

from .bitwise import assert_bitwise
from .local_ranks import RankFailure, init_ep_groups, run_local_ranks
from .test_numerics import EXPERT_BIAS
from .workers import Case, batches, train_arms


def test_units_split_exactly_the_microbatches_that_run_alone_somewhere():
    assert units(1, 2) == [Unit(0, 0), Unit(0, 1)]
    assert units(3, 2) == [Unit(0, 0), Unit(0, 1), Unit(1), Unit(2, 0), Unit(2, 1)]
    assert units(3, 1) == [Unit(m) for m in range(3)]
    # Halves cover the rows once, the first half taking the odd one.
    assert (Unit(0, 0).rows(5), Unit(0, 1).rows(5)) == (slice(0, 3), slice(3, 5))
    assert Unit(0).rows(5) == slice(0, 5)


def _problems(config=None, micro_batch_size=2, pipeline=1, **options) -> list[str]:
    """The rules table's lines for chunking (``options`` override ``EPOverlapOptions(moe_ep_overlap_chunks=2)``)."""
    model = dict(expert_model_parallel_size=2, num_moe_experts=4, moe_token_dispatcher_type="alltoall")
    model |= dict(
        pipeline_model_parallel_size=pipeline, virtual_pipeline_model_parallel_size=2 if pipeline > 1 else None
    )
    model |= config or {}
    violations = resolve(
        SimpleNamespace(**model), EPOverlapOptions(**({"moe_ep_overlap_chunks": 2} | options)),
        micro_batch_size=micro_batch_size,
    ).violations  # fmt: skip
    return [str(v) for v in violations if v.name.startswith("chunks")]


def test_chunk_rules_name_the_field_and_the_fix():
    assert _problems() == []
    assert _problems(moe_ep_overlap_chunks=1, overlap=False, pipeline=4, micro_batch_size=1) == []
    bad_config = dict(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001, moe_expert_capacity_factor=1.0)
    cases = {
        "ep_overlap.moe_ep_overlap_chunks=3": _problems(moe_ep_overlap_chunks=3),
        "comm_overlap.overlap_moe_expert_parallel_comm=False": _problems(overlap=False),
        "model.pipeline_model_parallel_size=2": _problems(pipeline=2),
        "ep_overlap.edge_pairing=True": _problems(edge_pairing=True),
        "train.micro_batch_size=1": _problems(micro_batch_size=1),
    }
    for field, lines in cases.items():
        (line,) = lines
        assert f"{field}:" in line and "Fix:" in line, line
    lines = _problems(config=bad_config)
    fields = ["model.moe_aux_loss_coeff=0.01", "model.moe_z_loss_coeff=0.001", "model.moe_expert_capacity_factor=1.0"]
    assert len(lines) == len(fields) and all(field in line for field, line in zip(fields, lines)), lines


CASES = {
    "ep2-fp32-N4": Case(),
    "ep2-fp32-N1-mixed": Case(microbatches=1, layer_freq=(0, 1)),
    "ep2-bf16-N3-main-grad": Case(bf16=True, main_grad=True, microbatches=3, micro_batch_size=3),
    "ep4-fp32-top1-N2": Case(world=4, ep=4, experts=8, topk=1, microbatches=2, layer_freq=(1, 1)),
    # The halves' token counts add up to the microbatch's, so the routing biases move as without chunking.
    "ep2-fp32-N3-expert-bias": Case(microbatches=3, extra=EXPERT_BIAS),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_chunked_schedule_is_bitwise_the_plain_path_over_the_halves(name):
    """Exactly what chunking computes: the plain path with each split microbatch given as its two halves."""
    case = CASES[name]
    case = Case(**{**vars(case), "arms": ("plain_units", "overlap_chunks", "delayed_chunks")})
    for outcome in run_local_ranks(train_arms, case.world, (case,)):
        arms = outcome.result
        reference = arms["plain_units"]
        for arm in ("overlap_chunks", "delayed_chunks"):
            for step in range(case.steps):
                assert_bitwise(reference["losses"][step], arms[arm]["losses"][step], f"{arm} step {step} losses")
                for param, grad in reference["grads"][step].items():
                    assert_bitwise(grad, arms[arm]["grads"][step][param], f"{arm} step {step} grad {param}")
            # Every unit ran beside another: the first and last microbatch as halves, so N + 2 units (2 for N = 1).
            ran = {r["microbatch"] for r in arms[arm]["comm"]}
            assert ran == set(range(2 if case.microbatches == 1 else case.microbatches + 2))
            assert not {r["phase"] for r in arms[arm]["compute"]} - {"warmup", "paired", "cooldown"}


# Largest difference from the unchunked plain path after one step, relative to the largest gradient of the
# tensor: rounding of two partial sums instead of one (fp32: ~1e-7 per addition; bf16: ~4e-3).
TOLERANCE = {False: 1e-5, True: 2e-2}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_chunked_differs_from_plain_by_rounding_only(bf16):
    case = Case(bf16=bf16, steps=1, arms=("plain", "delayed_chunks"))
    for outcome in run_local_ranks(train_arms, case.world, (case,)):
        plain, chunked = outcome.result["plain"], outcome.result["delayed_chunks"]
        a, b = plain["losses"][0].double(), chunked["losses"][0].double()
        assert ((a - b).abs() <= TOLERANCE[bf16] * a.abs()).all(), (a, b)
        for param, grad in plain["grads"][0].items():
            scale = grad.double().abs().max().item()
            diff = (grad.double() - chunked["grads"][0][param].double()).abs().max().item()
            assert diff <= TOLERANCE[bf16] * max(scale, 1e-12), f"{param}: {diff:g} of {scale:g}"


def _single_sequence(rank: int, world: int) -> None:
    groups = init_ep_groups(2, timedelta(seconds=30))
    case = Case(micro_batch_size=1 if rank == 1 else 2)
    engine = EPOverlapEngine(MoEGPTModel(case.config(), groups, seed=7), groups, overlap=True, moe_ep_overlap_chunks=2)
    engine.step(batches(case, rank, 0))


def test_a_single_sequence_microbatch_is_refused_on_every_rank():
    with pytest.raises(RankFailure) as failure:
        run_local_ranks(_single_sequence, 2, ())
    errors = [outcome.error for outcome in failure.value.outcomes]
    assert all(error and "bad microbatch input on rank(s) [1]" in error for error in errors), errors
    assert "microbatch 0: moe_ep_overlap_chunks=2 splits it" in errors[1]


def _chunks_without_overlap(rank: int, world: int) -> str:
    groups = init_ep_groups(2, timedelta(seconds=30))
    try:
        EPOverlapEngine(MoEGPTModel(Case().config(), groups, seed=7), groups, overlap=False, moe_ep_overlap_chunks=2)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def test_engine_refuses_chunks_it_cannot_run():
    outcomes = run_local_ranks(_chunks_without_overlap, 2, ())
    # The rules table's line, as the harness and the hook print it.
    assert all("[chunks_need_overlap] ep_overlap.moe_ep_overlap_chunks=2" in o.result for o in outcomes), outcomes
