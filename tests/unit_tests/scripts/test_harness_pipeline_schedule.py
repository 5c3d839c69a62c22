"""The harness's ``--pipeline_schedule``: what it cannot run is one line and exit status 2 before any rank starts; a
Megatron-Core pipeline's A/B (here on CPU ranks under the tests' stand-ins) compares overlap off and on in the same
ranks and says whether they are bitwise equal."""

import time

import ep_overlap_ab
import pytest
from argument_parser import parse_cli_args
from utils import ab_run
from utils.ab_summary import summarize
from utils.harness_config import arms_of, build_recipe
from utils.launch import specs_for
from utils.report import format_table

from ep_overlap_lab.multiprocess import run_local_ranks

TINY = [
    "--num_layers", "4", "--hidden_size", "32", "--num_attention_heads", "2", "--ffn_hidden_size", "32",
    "--moe_ffn_hidden_size", "32", "--num_moe_experts", "4", "--seq_length", "16", "--num_microbatches", "4",
]  # fmt: skip
DUALPIPEV = ["--pipeline_schedule", "dualpipev", "--pipeline_model_parallel_size", "2", "--nproc_per_node", "4"]
MCORE = ["--model_impl", "mcore", "--dist_backend", "gloo"]

# name: (flags after TINY, the line)
REFUSED = {
    "pp1": (
        ["--pipeline_schedule", "dualpipev", *MCORE],
        "error: --pipeline_schedule=dualpipev: DualPipeV runs 2P stages on P pipeline ranks, and "
        "pipeline_model_parallel_size=1 is no pipeline; add --pipeline_model_parallel_size 2 (or more), or drop the "
        "flag",
    ),
    "too-few-microbatches": (
        [*DUALPIPEV, *MCORE, "--num_microbatches", "3"],
        "error: --num_microbatches=3: DualPipeV on 2 pipeline ranks needs at least 2 x 2 = 4 microbatches; raise "
        "--num_microbatches to 4, or use --pipeline_schedule 1f1b",
    ),
    "odd-layer-split": (
        [*DUALPIPEV, *MCORE, "--num_layers", "6"],
        "error: --num_layers=6: DualPipeV splits the layers into 2 x pipeline_model_parallel_size = 4 equal stages; "
        "use a multiple of 4 layers, or another --pipeline_schedule",
    ),
    "reference-model": (
        DUALPIPEV,
        "error: --pipeline_schedule=dualpipev: the reference model's engine runs 1F1B and interleaved pipelines, not "
        "DualPipeV; add --model_impl mcore (a Megatron-Core GPTModel)",
    ),
    "nccl": (
        [*DUALPIPEV, "--model_impl", "mcore"],
        "error: --pipeline_schedule=dualpipev: its P2P are tagged gloo messages (NCCL matches them by order; not "
        "built); add --dist_backend gloo (local ranks)",
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_dualpipev_request_it_cannot_run_is_one_line_before_any_rank(name, monkeypatch, capsys):
    monkeypatch.setattr(ab_run.torch.cuda, "is_available", lambda: True)  # past the CUDA check of --model_impl mcore
    monkeypatch.setattr(ab_run.torch.cuda, "device_count", lambda: 4)
    flags, line = REFUSED[name]
    assert ep_overlap_ab.main([*TINY, "--ab", *flags]) == 2  # no -d: it would have started the ranks
    out = capsys.readouterr()
    assert line in out.err.splitlines(), out.err
    assert "running arm" not in out.out


def _rank(rank: int, world: int, specs: list, slow_rank: int | None) -> dict:
    from utils import mcore_pipeline
    from utils.arms import run_arms

    from ..training.ep_overlap.mcore_cpu import init_megatron, install_cpu_stubs

    install_cpu_stubs()
    m = specs[0].model
    init_megatron(m.expert_model_parallel_size, m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size)
    if rank == slow_rank:  # its peers wait 0.8 s for its first activation of each step
        forward_step, seen = mcore_pipeline.forward_step, set()

        def slow(data_iterator, model, **kwargs):
            if id(data_iterator) not in seen:
                seen.add(id(data_iterator))
                time.sleep(0.8)
            return forward_step(data_iterator, model, **kwargs)

        mcore_pipeline.forward_step = slow
    return run_arms(rank, world, specs)


def run_ab(flags: list[str], slow_rank: int | None = None) -> tuple[dict, dict]:
    args = parse_cli_args([*TINY, "--ab", "-ms", "2", *MCORE, *flags])
    recipe = build_recipe(args)
    specs = specs_for(arms_of(recipe, args), recipe, "cpu", "mcore", None, args.pipeline_schedule)
    outcomes = run_local_ranks(_rank, args.nproc_per_node, (specs, slow_rank))
    results = {spec.name: [o.result[spec.name] for o in outcomes] for spec in specs}
    return results, summarize(results, recipe, args, "cpu", args.nproc_per_node)


@pytest.mark.wide
@pytest.mark.parametrize(
    "flags, schedule",
    [
        (DUALPIPEV, "dualpipev"),
        (["--pipeline_model_parallel_size", "2", "--virtual_pipeline_model_parallel_size", "2",
          "--nproc_per_node", "4"], "interleaved"),
    ],
)  # fmt: skip
def test_a_megatron_core_pipeline_ab_is_bitwise_and_says_so(flags, schedule):
    # On 4 CPU ranks (PP 2 x EP 2), a rank 0.8 s late with each step's first forward: its peers' P2P waits outlast
    # any polling slice (gloo closes a connection whose receive wait times out).
    results, summary = run_ab(flags, slow_rank=3)
    assert {r["pipeline_schedule"] for arm in results.values() for r in arm} == {schedule}
    assert summary["numerics"]["bitwise_equal"], summary["numerics"]
    assert any(bits.abs().sum() > 0 for r in results["overlap"] for bits in r["loss_bits"])  # a loss was computed
    assert "losses and final parameters bitwise equal: yes" in format_table(summary)


def test_print_schedule_draws_dualpipevs_timeline_for_megatron_core_chunks(monkeypatch, capsys):
    monkeypatch.setattr(ab_run.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ab_run.torch.cuda, "device_count", lambda: 4)
    assert ep_overlap_ab.main([*TINY, "--ab", *DUALPIPEV, *MCORE, "--print_schedule", "-d"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "rank 0  |F0|F1|F2|f0|b0   |f1|F3b1 ...|f2B0 |b2   |f3B1 |b3   |B2   ......|B3   " in lines, lines
    assert "rank 1  ...|F0|f0|F1|f1|F2|b0   |f2B0 |F3b1 |f3B1 |b2   |B2   |b3   |B3   ......" in lines, lines
