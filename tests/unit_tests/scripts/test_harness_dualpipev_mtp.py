"""The harness's DualPipeV with an MTP layer: the request runs (no refusal), the harness's own parallel state has
the V's embedding group (rank 0 alone), and its A/B (overlap off and on under DualPipeV, on CPU ranks under the
tests' stand-ins) is bitwise equal and says so."""

import ep_overlap_ab
import pytest
from utils import ab_run
from utils.report import format_table

from ep_overlap_lab.multiprocess import run_local_ranks

from .test_harness_pipeline_schedule import DUALPIPEV, MCORE, TINY

MTP = ["--mtp_num_layers", "1"]


def test_dualpipev_with_mtp_is_no_longer_refused(monkeypatch, capsys):
    monkeypatch.setattr(ab_run.torch.cuda, "is_available", lambda: True)  # past the CUDA check of --model_impl mcore
    monkeypatch.setattr(ab_run.torch.cuda, "device_count", lambda: 4)
    assert ep_overlap_ab.main([*TINY, "--ab", *DUALPIPEV, *MCORE, *MTP, "--print_schedule", "-d"]) == 0, (
        capsys.readouterr().err
    )


def _rank(rank: int, world: int, specs: list) -> dict:
    from megatron.core import parallel_state
    from utils.arms import run_arms

    from ..training.ep_overlap.mcore_cpu import install_cpu_stubs, plain_cuda_rng

    install_cpu_stubs()
    plain_cuda_rng()
    result = run_arms(rank, world, specs)  # the harness initializes Megatron-Core's parallel state
    result["embedding_ranks"] = (
        sorted(parallel_state._EMBEDDING_GLOBAL_RANKS) if parallel_state.is_rank_in_embedding_group() else None
    )
    return result


@pytest.mark.wide
def test_a_dualpipev_ab_with_mtp_is_bitwise_and_says_so():
    from argument_parser import parse_cli_args
    from utils.ab_summary import summarize
    from utils.harness_config import arms_of, build_recipe
    from utils.launch import specs_for

    args = parse_cli_args([*TINY, "--ab", "-ms", "2", *MCORE, *DUALPIPEV, *MTP])
    recipe = build_recipe(args)
    specs = specs_for(arms_of(recipe, args), recipe, "cpu", "mcore", None, args.pipeline_schedule)
    outcomes = run_local_ranks(_rank, args.nproc_per_node, (specs,))
    # PP 2 x EP 2: pipelines {0, 2} and {1, 3}; each one's pipeline rank 0 is its embedding group, alone
    assert [o.result["embedding_ranks"] for o in outcomes] == [[0], [1], None, None]
    results = {spec.name: [o.result[spec.name] for o in outcomes] for spec in specs}
    summary = summarize(results, recipe, args, "cpu", args.nproc_per_node)
    assert summary["numerics"]["bitwise_equal"], summary["numerics"]
    assert any(bits.abs().sum() > 0 for r in results["overlap"] for bits in r["loss_bits"])
    assert "losses and final parameters bitwise equal: yes" in format_table(summary)
