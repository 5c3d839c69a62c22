"""Transformer Engine CUDA graphs: the plan replays each layer's graphed callable wherever the plain path does.

A stand-in for Transformer Engine's graphed callables (``graph_standin.py``) records every replay: which layer, which
microbatch's graph, and a checksum of each input. Megatron-Core's driver runs the plain path (overlap off), Megatron-
Core's own plan (``GPTModel``) and this project's plan through the hook; each must replay the same graphs with the same
inputs the same number of times, with losses and gradients bitwise equal. With delayed wgrad, each graph's
``backward_dw`` runs as Megatron-Core's plan runs it.
"""

import pytest

from .bitwise import assert_bitwise
from .local_ranks import run_local_ranks
from .mcore_arms import run_arm
from .mcore_cpu import init_megatron, install_cpu_stubs
from .mcore_models import HybridCase, McoreCase
from .test_mcore_hook import count_norm_recomputes

ROUTER = ["attn", "moe_router", "moe_preprocess"]
AT_BUILD = (("cuda_graph_impl", "transformer_engine"), ("cuda_graph_modules", ROUTER))
# name -> (case, cuda_graph_modules, arms)
CASES = {
    "gpt-attn-router-preprocess": (
        McoreCase(layer_freq=(1, 0, 1), microbatches=3),
        ROUTER,
        ("plain", "mcore", "hook"),
    ),
    "gpt-attn": (McoreCase(layer_freq=(1, 0, 1), microbatches=3), ["attn"], ("plain", "mcore", "hook")),
    "gpt-router-no-attn-shared": (
        McoreCase(microbatches=3, shared_ffn=16),
        ["moe_router"],
        ("plain", "mcore", "hook"),
    ),
    "gpt-router-delayed-wgrad": (
        McoreCase(microbatches=3, delay_wgrad=True, shared_ffn=16),
        ["attn", "moe_router"],
        ("plain", "mcore", "hook"),
    ),
    # The MTP depth's layer is graphed too; the plan runs the MTP block whole in its head, each graph replayed there.
    "gpt-mtp-attn-router-preprocess": (
        McoreCase(layer_freq=(1, 0, 1), microbatches=3, mtp=True),
        ROUTER,
        ("plain", "hook"),
    ),
    # Recompute of 'layernorm' (the config's graph scopes set at build, where Megatron-Core decides it per layer): the
    # graph registers the norm's recompute on its outputs; the plan's experts node registers none of its own (Megatron-
    # Core's own plan does, on the checkpoint the layer kept: left out of the arms).
    "gpt-router-preprocess-layernorm": (
        McoreCase(layer_freq=(1, 0, 1), microbatches=3, recompute=("layernorm",), config=AT_BUILD),
        ROUTER,
        ("plain", "hook"),
    ),
    # With delayed wgrad the head runs the MTP depth's graph backward_dw after the MTP block's backward.
    "gpt-mtp-router-delayed-wgrad": (
        McoreCase(layer_freq=(1, 0, 1), microbatches=3, mtp=True, delay_wgrad=True, shared_ffn=16),
        ROUTER,
        ("plain", "hook"),
    ),
    # A hybrid stack's attention layers run whole in the plan: their graphs replay there.
    "hybrid-attn-router": (HybridCase(pattern="*E*E-", microbatches=3), ROUTER, ("plain", "hook")),
}


def replay_graphs(rank: int, world: int, name: str) -> dict:
    from . import graph_standin

    case, modules, arms = CASES[name]
    install_cpu_stubs()
    init_megatron(world)
    graph_standin.install()
    rebuilt = count_norm_recomputes()
    out = {}
    for arm in arms:
        rebuilt.clear()
        graph_standin.REPLAYS.clear()
        graph_standin.WGRADS.clear()
        graphed = []

        def prepare(model, graphed=graphed):
            graphed.append(graph_standin.capture(model, case.microbatches, modules))
            # Graphed wgrad needs Transformer Engine's fused accumulation (the rules ask for it); the local linears
            # read the field when built, so here it satisfies the rule and changes no module.
            model.config.gradient_accumulation_fusion = case.delay_wgrad

        result = run_arm(arm, case, prepare=prepare)
        out[arm] = {
            "losses": result["losses"],
            "grads": result["grads"],
            "replays": dict(graph_standin.REPLAYS),
            "wgrads": dict(graph_standin.WGRADS),
            "graphed": graphed[0],
            "norm_recomputes": len(rebuilt),
        }
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_plan_replays_the_graphs_the_plain_path_replays_bitwise(name):
    case, modules, arms = CASES[name]
    for outcome in run_local_ranks(replay_graphs, case.world, (name,)):
        plain = outcome.result["plain"]
        assert plain["graphed"] > 0 and plain["replays"], "nothing was graphed"
        # every graph of every graphed layer replayed once per step, each microbatch its own
        assert sum(plain["replays"].values()) == plain["graphed"] * case.microbatches * case.steps
        assert {index for _, index, _ in plain["replays"]} == set(range(case.microbatches))
        for arm in arms[1:]:
            got = outcome.result[arm]
            assert got["replays"] == plain["replays"], f"rank {outcome.rank} {arm}"
            assert got["norm_recomputes"] == plain["norm_recomputes"], f"rank {outcome.rank} {arm}"
            for step, (want, have) in enumerate(zip(plain["losses"], got["losses"])):
                assert_bitwise(want, have, f"rank {outcome.rank} {arm} step {step} losses")
            assert got["grads"].keys() == plain["grads"].keys()
            for param, grad in plain["grads"].items():
                assert_bitwise(grad, got["grads"][param], f"rank {outcome.rank} {arm} {param}")
        if case.delay_wgrad:  # each graph's backward_dw once per step, as in Megatron-Core's plan where it runs
            hook = outcome.result["hook"]["wgrads"]
            assert sum(hook.values()) == plain["graphed"] * case.microbatches * case.steps, hook
            mcore = outcome.result["mcore"]["wgrads"] if "mcore" in arms else hook
            assert hook == mcore, {"mcore": mcore, "hook": hook}


def _engine_with_graphs(rank: int, world: int) -> str:
    from . import graph_standin

    install_cpu_stubs()
    init_megatron(world)
    graph_standin.install()
    case = McoreCase(microbatches=2)
    try:
        run_arm("engine", case, prepare=lambda m: graph_standin.capture(m, case.microbatches, ROUTER))
    except ValueError as error:
        return str(error)
    return "accepted"


@pytest.mark.lab
def test_the_engine_refuses_graphed_layers_before_its_first_op():
    for outcome in run_local_ranks(_engine_with_graphs, 2):
        assert "replay Transformer Engine CUDA graphs" in outcome.result, outcome.result
        assert "use_ep_overlap_schedule" in outcome.result
