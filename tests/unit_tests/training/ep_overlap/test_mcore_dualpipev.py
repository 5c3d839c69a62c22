"""DualPipeV under Megatron-Core's driver contract: bitwise equal to Megatron-Core's plain 1F1B with the overlap off.

The same 4-layer ``GPTModel`` (a dense first layer, then MoE) on PP 2 x EP 2 (4 ranks) twice. The reference runs
Megatron-Core's non-interleaved 1F1B schedule (stages of two layers). The other builds DualPipeV's four one-layer
stages (rank 0: stages 0 and 3, with the embedding, the output layer and the loss; rank 1: stages 1 and 2), weights
keyed by global name, and takes its schedule from ``ep_overlap.mcore.get_forward_backward_func()`` with the config's
``ep_overlap_pipeline_schedule = "dualpipev"``: overlap off, then overlap on (the plan's paired F&B steps). Over 2
optimizer steps every loss, every gradient and every parameter after the steps must be bitwise equal, and so must the
losses of a forward-only step after them; each rank's P2P must be the generated op list's, transfer for
transfer. Both layouts run Megatron-Core's ``finalize_model_grads`` (DDP's calls stubbed). A ``HybridModel`` with an
MTP depth runs the same way: its pattern's four segments are DualPipeV's stages, joined in pairs for 1F1B; the
parallel state of the V has its embedding group (rank 0 alone), and the two copies of the embedding (stage 0's, MTP's)
are compared apart. Each chunk's checkpoint names must be 1F1B's. Cases beyond those are ``full`` (below).
"""

from dataclasses import replace
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from .bitwise import assert_bitwise
from .local_ranks import run_local_ranks
from .mcore_cpu import init_megatron, install_cpu_stubs, plain_cuda_rng
from .mcore_models import HybridCase, McoreCase, build_hybrid, gpt_config, gpt_model, install_kernels_for
from .mcore_stages import build_plans, global_name, set_weights
from .test_mcore_hook import MICRO_BATCH, SEQ, bridge_style_forward_step
from .test_plain_pipeline import _step_data

# The slower cases (more ranks, more arms) run with -m wide; make test holds the P = 2 case.
full = pytest.mark.wide
PP = 2
CASE = McoreCase(layer_freq=(0, 1, 1, 1), microbatches=2 * PP, steps=2)
# name: (case, pipeline size); one layer per DualPipeV stage, a dense first layer
# A hybrid stack (Mamba, attention, MoE, dense MLP) with an MTP depth: the pattern's 2P segments are the stages.
HYBRID = HybridCase(pattern="ME|*E|ME|E-/*E", microbatches=2 * PP, steps=2)
CASES = {"gpt-dense-first-N4": (CASE, PP), "hybrid-mtp-N4": (HYBRID, PP)}
FULL_CASES = {
    "gpt-mtp-N4": (replace(CASE, mtp=True), PP),
    "gpt-mtp-N5-delayed-wgrad": (replace(CASE, microbatches=5, mtp=True, delay_wgrad=True), PP),
    "hybrid-N5": (replace(HYBRID, pattern="ME|*E|ME|E-", microbatches=5), PP),
    "gpt-mtp-pp4-N8": (McoreCase(layer_freq=(0, 1, 1, 1, 1, 1, 1, 1), microbatches=8, steps=2, mtp=True), 4),
    "hybrid-mtp-pp4-N8": (replace(HYBRID, pattern="M|E|*|E|M|E|-|E/*E", microbatches=8), 4),
    # finalize_model_grads divides by the step's token count, which it broadcasts from the last pipeline rank.
    "gpt-per-token-loss-N4": (replace(CASE, per_token_loss=True), PP),
    # With MTP as well: rank 0's two copies of the embedding are summed before that division, as the embedding
    # group's all-reduce is in 1F1B.
    "gpt-mtp-per-token-loss-N4": (replace(CASE, mtp=True, per_token_loss=True), PP),
    "hybrid-mtp-per-token-loss-N4": (replace(HYBRID, config=(("calculate_per_token_loss", True),)), PP),
    # The output layer tied to the embedding: both on rank 0, each copy's gradient their sum.
    "gpt-tied-N4": (replace(CASE, tied=True), PP),
    # Megatron-Core's pipeline_model_parallel_layout as the V's 2P stages: uneven, the last stage the loss alone; with
    # MTP beside the loss on stage 2P-1, the final norm on stage 2P-2. 1F1B runs the stages joined in pairs.
    "gpt-layout-uneven-N4": (replace(CASE, config=(("pipeline_model_parallel_layout", "Ett|t|t|L"),)), PP),
    # The embedding and the loss counted as layers: stages 0 and 2P-1 (both on rank 0) hold one layer fewer.
    "gpt-account-for-embedding-and-loss-N4": (
        replace(
            CASE,
            layer_freq=(0, 1, 1, 1, 1, 1),
            config=(("account_for_embedding_in_pipeline_split", True), ("account_for_loss_in_pipeline_split", True)),
        ),
        PP,
    ),
    "gpt-mtp-layout-N4": (replace(CASE, mtp=True, config=(("pipeline_model_parallel_layout", "Et|tt|t|mL"),)), PP),
    "gpt-N5-delayed-wgrad": (replace(CASE, microbatches=5, delay_wgrad=True), PP),
    "gpt-pp4-N8": (McoreCase(layer_freq=(0, 1, 1, 1, 1, 1, 1, 1), microbatches=8, steps=2), 4),
    "gpt-pp4-N9-delayed-wgrad": (
        McoreCase(layer_freq=(0, 1, 1, 1, 1, 1, 1, 1), microbatches=9, steps=2, delay_wgrad=True),
        4,
    ),
}


def dualpipev_models(case: McoreCase, pp: int) -> list:
    """This rank's chunks for DualPipeV's stages r and 2P-1-r (``dualpipev_chunks``) of ``case``'s model; a hybrid
    pattern's 2P segments are the stages."""
    from megatron.bridge.training.ep_overlap.mcore.dualpipev_chunks import dualpipev_chunks

    if isinstance(case, HybridCase):
        mtp = SimpleNamespace(mtp_num_layers=case.pattern.count("/") or None)
        return dualpipev_chunks(
            lambda hybrid_layer_pattern, pg_collection, **chunk: build_hybrid(
                replace(case, pattern=hybrid_layer_pattern), pp=pp, vpp=2, **chunk
            ),
            mtp,
            hybrid_layer_pattern=case.pattern,
        )
    config = gpt_config(
        case, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=2, pipeline_dtype=torch.float32
    )
    return dualpipev_chunks(
        lambda **chunk: gpt_model(case, config, **chunk), config, share_embeddings_and_output_weights=case.tied
    )


def one_f_one_b_case(case: McoreCase, pp: int) -> McoreCase:
    """``case`` for Megatron-Core's 1F1B on ``pp`` ranks: a hybrid pattern's 2P stages joined in pairs, and so a
    ``pipeline_model_parallel_layout``'s."""
    fields = dict(case.config)
    if layout := fields.get("pipeline_model_parallel_layout"):
        case = replace(case, config=tuple((fields | {"pipeline_model_parallel_layout": _pairs(layout)}).items()))
    if not isinstance(case, HybridCase):
        return case
    main, slash, mtp = case.pattern.partition("/")
    return replace(case, pattern=_pairs(main) + slash + mtp)


def _pairs(stages: str) -> str:
    """``|``-separated stages joined in pairs: stage j of 1F1B on P ranks holds the V's stages 2j and 2j+1."""
    stages = stages.split("|")
    return "|".join(a + b for a, b in zip(stages[::2], stages[1::2]))


def init_layout(case: McoreCase, pp: int, layout: str) -> None:
    """Megatron-Core's parallel state: DualPipeV's two virtual stages and the V's embedding group (rank 0 alone)."""
    if layout != "dualpipev":
        return init_megatron(case.world, pp)
    from megatron.core import parallel_state

    from megatron.bridge.training.ep_overlap.mcore.dualpipev_chunks import dualpipev_embedding_ranks

    parallel_state.initialize_model_parallel(
        expert_model_parallel_size=case.world, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=2, get_embedding_ranks=dualpipev_embedding_ranks,
    )  # fmt: skip
    plain_cuda_rng()


class WithoutDDP:
    """What Megatron-Core's ``finalize_model_grads`` calls on a DDP-wrapped chunk, for a bare one: no data-parallel
    sum (the tests compare each data rank's gradients), ``scale_gradients`` on ``.grad``."""

    @staticmethod
    def equip(model) -> None:
        from megatron.core.distributed import DistributedDataParallelConfig

        model.ddp_config = DistributedDataParallelConfig()
        model.finish_grad_sync = lambda force_all_reduce=False: None
        model.scale_gradients = lambda scale: [p.grad.mul_(scale) for p in model.parameters() if p.grad is not None]


def named_parameters(plan, ep_rank: int) -> list:
    """``plan``'s parameters by global name; stage 2P-1's copy of the embedding (MTP's) named apart."""
    copy = not plan.model.pre_process
    return [
        (global_name(plan, n, 2, ep_rank) + (" (copy)" if copy and n.startswith("embedding.") else ""), p)
        for n, p in plan.model.named_parameters()
    ]


@torch.no_grad()
def set_mixer_vectors(plans, ep_rank: int) -> None:
    """A Mamba mixer's vectors (``A_log``, ``D``, ``dt_bias``, the conv bias, its norm) by global name as well:
    ``set_weights`` sets the matrices, and these come from the torch generator, whose state at a layer depends on
    what its chunk built before it (a 1F1B stage with MTP builds its embedding first)."""
    for plan in plans:
        for name, param in plan.model.named_parameters():
            if param.dim() == 1 and ".mixer." in name:
                key = global_name(plan, name, 2, ep_rank)
                seed = sum(ord(c) * 131**i for i, c in enumerate(key)) % (2**61)
                param.copy_(0.5 + 0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)))


def train(rank: int, world: int, case: McoreCase, layout: str, pp: int = PP) -> dict:
    install_cpu_stubs()
    install_kernels_for(case)
    init_layout(case, pp, layout)
    from megatron.core import parallel_state
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import schedules

    from megatron.bridge.training.ep_overlap.mcore import chunk_for, get_forward_backward_func, use_ep_overlap_schedule

    ep_rank, data_rank = parallel_state.get_expert_model_parallel_rank(), parallel_state.get_data_parallel_rank()
    arms = ("plain", "overlap") if layout == "dualpipev" else ("reference",)
    out = {"data_rank": data_rank}
    for arm in arms:
        if layout == "dualpipev":
            plans = [chunk_for(model) for model in dualpipev_models(case, pp)]
            copied = plans[1].model.config.mtp_num_layers or case.tied
            if any(plan.model.pre_process for plan in plans) and copied:
                # Rank 0's copy of the embedding (MTP's, or the tied output layer), as built: the embedding's values
                # (1F1B: its all-reduce's)
                copies = [plan.model.shared_embedding_or_output_weight() for plan in plans]
                out["copy_as_built"] = torch.equal(*copies) and bool(copies[1].abs().sum() > 0)
            set_weights(plans, local_experts=2, ep_rank=ep_rank)
        else:
            plans = build_plans(one_f_one_b_case(case, pp), pp, None)
        set_mixer_vectors(plans, ep_rank)
        models = [plan.model for plan in plans]
        for model in models:
            WithoutDDP.equip(model)
        for config in {id(model.config): model.config for model in models}.values():  # a hybrid chunk: its own
            config.finalize_model_grads_func = finalize_model_grads
            config.batch_p2p_comm, config.overlap_p2p_comm = False, False  # gloo: unbatched P2P
            config.overlap_moe_expert_parallel_comm = arm == "overlap"
            config.delay_wgrad_compute = arm == "overlap" and case.delay_wgrad
            config.ep_overlap_pipeline_schedule = "dualpipev" if layout == "dualpipev" else None
        if arm == "overlap":
            use_ep_overlap_schedule(models, timeout=timedelta(seconds=30))
        if layout == "dualpipev":
            chosen = get_forward_backward_func(pp_size=pp, vp_size=2)
        else:
            chosen = schedules.forward_backward_pipelining_without_interleaving
        named = [named for plan in plans for named in named_parameters(plan, ep_rank)]
        optimizer = torch.optim.Adam([p for _, p in named], lr=1e-2)
        losses, grads, p2p = [], [], []
        for step in range(case.steps):
            data = _step_data(step, data_rank, case.microbatches)
            iterators = [iter(data), iter(list(data))] if layout == "dualpipev" else iter(data)
            extra = {"p2p_log": p2p} if layout == "dualpipev" else {}
            store = chosen(
                forward_step_func=bridge_style_forward_step, data_iterator=iterators, model=models,
                num_microbatches=case.microbatches, seq_length=SEQ, micro_batch_size=MICRO_BATCH, **extra,
            )  # fmt: skip
            losses.append(torch.stack([logged["lm loss"] for logged in store]) if store else None)
            grads.append({n: p.grad.clone() for n, p in named if p.grad is not None})
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        # An evaluation step (forward only) on step 0's data: its losses go after the training steps'.
        data = _step_data(0, data_rank, case.microbatches)
        iterators = [iter(data), iter(list(data))] if layout == "dualpipev" else iter(data)
        store = chosen(
            forward_step_func=bridge_style_forward_step, data_iterator=iterators, model=models,
            num_microbatches=case.microbatches, seq_length=SEQ, micro_batch_size=MICRO_BATCH, forward_only=True,
        )  # fmt: skip
        losses.append(torch.stack([logged["lm loss"] for logged in store]) if store else None)
        recorder = getattr(getattr(models[0], "build_schedule_plan", None), "recorder", None)
        phases = {str(r.phase) for r in recorder.comm if r.op == "dispatch"} if recorder is not None else set()
        params = {n: p.detach().clone() for n, p in named}
        out[arm] = {"losses": losses, "grads": grads, "params": params, "p2p": p2p, "phases": phases}
    out["pp_rank"] = parallel_state.get_pipeline_model_parallel_rank()
    return out


def _by_pipeline(outcomes, arm: str) -> dict:
    """Per data-parallel rank: the pipeline's losses per step and its gradients and parameters by global name."""
    merged = {}
    for outcome in outcomes:
        result = outcome.result[arm]
        into = merged.setdefault(outcome.result["data_rank"], {"losses": {}, "grads": {}, "params": {}})
        for step, losses in enumerate(result["losses"]):
            if losses is not None:
                into["losses"][step] = losses
        for step, grads in enumerate(result["grads"]):
            into["grads"].update({(step, name): grad for name, grad in grads.items()})
        into["params"].update(result["params"])
    return merged


def _assert_pipelines_bitwise(reference: dict, run: dict, where: str) -> None:
    assert reference.keys() == run.keys()
    for data_rank, ref in reference.items():
        got = run[data_rank]
        for part in ("losses", "grads", "params"):
            assert ref[part].keys() == got[part].keys() and ref[part], f"{where} {part}: {ref[part].keys()}"
            for key, value in ref[part].items():
                assert_bitwise(value, got[part][key], f"{where} data rank {data_rank} {part} {key}")


def assert_dualpipev_matches_1f1b(case: McoreCase, pp: int) -> None:
    from megatron.bridge.training.ep_overlap.program.dualpipev import dualpipev_schedule

    world = pp * case.world
    reference = _by_pipeline(run_local_ranks(train, world, (case, "1f1b", pp)), "reference")
    outcomes = run_local_ranks(train, world, (case, "dualpipev", pp))
    for arm in ("plain", "overlap"):
        _assert_pipelines_bitwise(reference, _by_pipeline(outcomes, arm), f"DualPipeV {arm}")
        for outcome in outcomes:
            steps = dualpipev_schedule(pp, case.microbatches, outcome.result["pp_rank"], overlap=arm == "overlap")
            generated = [(op, t) for s in steps for op, ts in (("recv", s.recv), ("send", s.send)) for t in ts]
            assert outcome.result[arm]["p2p"] == generated * case.steps, f"rank {outcome.rank} {arm}"
    assert {"paired"} <= set().union(*(o.result["overlap"]["phases"] for o in outcomes))
    copied = bool(case.mtp or case.tied or "/" in getattr(case, "pattern", ""))
    copies = [o.result.get("copy_as_built") for o in outcomes if o.result["pp_rank"] == 0]
    assert copies == [True if copied else None] * case.world, "rank 0's copy of the embedding as built"


@pytest.mark.parametrize("name", sorted(CASES))
def test_dualpipev_is_bitwise_equal_to_megatron_cores_1f1b(name):
    assert_dualpipev_matches_1f1b(*CASES[name])


@full
@pytest.mark.parametrize("name", sorted(FULL_CASES))
def test_dualpipev_full_cases_are_bitwise_equal_to_megatron_cores_1f1b(name):
    assert_dualpipev_matches_1f1b(*FULL_CASES[name])


# The V's chunks against 1F1B's on PP 2 (EP 1): every checkpoint name (sharded key, global offset and shape, replica
# id) and each chunk's local names, under which a load hands the tensors back to it.
CHECKPOINT_CASES = {
    # A layout: Megatron-Core's block takes its local layers' offset from the parallel state's pipeline rank.
    "gpt-tied-layout": replace(CASE, world=1, tied=True, config=(("pipeline_model_parallel_layout", "Et|tt|t|L"),)),
    "gpt-mtp": replace(CASE, world=1, mtp=True),
    "hybrid-mtp": replace(HYBRID, world=1),
}


@pytest.mark.parametrize(
    "name", [n if n == "gpt-tied-layout" else pytest.param(n, marks=full) for n in sorted(CHECKPOINT_CASES)]
)
def test_the_v_chunks_checkpoint_names_are_1f1bs(name):
    case = CHECKPOINT_CASES[name]
    names = {
        layout: set().union(*(o.result for o in run_local_ranks(_checkpoint_names, PP, (case, layout))))
        for layout in ("1f1b", "dualpipev")
    }
    assert names["dualpipev"] == names["1f1b"] and len(names["1f1b"]) > 40, names["dualpipev"] ^ names["1f1b"]


def _checkpoint_names(rank: int, world: int, case: McoreCase, layout: str) -> set:
    install_cpu_stubs()
    install_kernels_for(case)
    init_layout(case, world, layout)
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if layout == "dualpipev":
        models = dualpipev_models(case, world)
    else:
        models = [plan.model for plan in build_plans(one_f_one_b_case(case, world), world, None)]
    names = set()
    for model in models:
        sharded = model.sharded_state_dict()
        local = {name for name in model.state_dict() if not name.endswith("_extra_state")}
        if local != {name for name in sharded if not name.endswith("_extra_state")}:
            names.add(("local names differ", rank, tuple(sorted(local ^ set(sharded)))))
        names |= {
            (t.key, tuple(t.global_offset), tuple(t.global_shape), t.replica_id)
            for t in nested_values(sharded)
            if isinstance(t, ShardedTensor)
        }
    return names


# name: (microbatches, what is set on the built chunks' config, on the built chunks, a line). The ranks run
# Megatron-Core's default embedding group (first and last pipeline rank), with which no V chunk with MTP or a tied
# output layer builds (below), so those are set after.
REFUSED = {
    "too-few-microbatches": (
        2 * PP - 1,
        {},
        {},
        "DualPipeV needs num_microbatches >= 2 x pipeline_model_parallel_size = 4 (got 3); fix: ",
    ),
    "mtp-default-embedding-group": (
        2 * PP,
        {"mtp_num_layers": 1},
        {},
        "DualPipeV with mtp_num_layers=1 needs the V layout's embedding group",
    ),
    "tied-default-embedding-group": (
        2 * PP,
        {},
        {"share_embeddings_and_output_weights": True},
        "DualPipeV with share_embeddings_and_output_weights=True needs the V layout's embedding group",
    ),
    "one-chunk": (2 * PP, {}, {"chunks": 1}, "DualPipeV runs two model chunks per pipeline rank"),
    "layout-mtp-off-the-last-stage": (  # chunks built by other means than dualpipev_chunks
        2 * PP,
        {"pipeline_model_parallel_layout": "Et|ttt|m|L"},
        {},
        "DualPipeV runs MTP beside the loss on stage 3 (pipeline rank 0, with the embedding), and ",
    ),
    "activation-offloading": (
        2 * PP,
        {"fine_grained_activation_offloading": True},
        {},
        "DualPipeV does not run fine_grained_activation_offloading=True yet; fix: ",
    ),
    "ddp-overlap-grad-reduce": (
        2 * PP,
        {"grad_sync_func": print},
        {},
        "DualPipeV does not call config.grad_sync_func yet (DDP's overlapped grad reduce); fix: ",
    ),
}


@full
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_dualpipev_does_not_run_is_refused_before_any_step(name):
    *change, line = REFUSED[name]
    for outcome in run_local_ranks(_refused, 4, tuple(change)):
        lines = outcome.result.splitlines()
        assert any(got.startswith(line) for got in lines), outcome.result
        assert all("fix: " in got for got in lines), outcome.result


def test_a_refusal_on_one_rank_is_every_ranks_so_none_waits_in_a_p2p():
    # Pipeline rank 1's chunks were not built by dualpipev_chunks (as Bridge's own build on a middle rank, whose
    # pre/post flags look right); rank 0's were. Without the agreement rank 0 would run on and wait for rank 1.
    outcomes = run_local_ranks(_refused_on_rank_1, 4, collective_timeout_s=60.0)
    by_pipeline = {o.result[0]: o.result[1] for o in outcomes}
    assert by_pipeline[1].startswith("model[0] of pipeline rank 1 was not built as DualPipeV's stage 1"), by_pipeline
    assert by_pipeline[0].startswith("rank ") and "refused this model, so every rank does: " in by_pipeline[0]


def _refused_on_rank_1(rank: int, world: int) -> tuple[int, str]:
    install_cpu_stubs()
    init_megatron(CASE.world, PP, 2)
    from megatron.core import parallel_state
    from megatron.core.utils import get_attr_wrapped_model

    from megatron.bridge.training.ep_overlap.mcore import get_forward_backward_func

    models = dualpipev_models(CASE, PP)
    pipeline_rank = parallel_state.get_pipeline_model_parallel_rank()
    if pipeline_rank == 1:
        for model in models:
            del get_attr_wrapped_model(model, "pre_process", return_model_obj=True).dualpipev_stage
    models[0].config.ep_overlap_pipeline_schedule = "dualpipev"
    data = _step_data(0, 0, 2 * PP)
    try:
        get_forward_backward_func(pp_size=PP, vp_size=2)(
            forward_step_func=bridge_style_forward_step, data_iterator=[iter(data), iter(data)], model=models,
            num_microbatches=2 * PP, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
        )  # fmt: skip
    except ValueError as error:
        return pipeline_rank, str(error)
    return pipeline_rank, "ran"


def test_the_chunk_builder_refuses_mtp_with_megatron_cores_embedding_group_before_building():
    # Its default group (first and last pipeline rank) would all-reduce rank 0's copy of the embedding with a rank
    # that holds none: the build would block. Both ranks that hold it refuse before building a chunk.
    results = run_local_ranks(_built_with_default_embedding_group, 2, ())
    line = "DualPipeV with mtp_num_layers=1 needs the V layout's embedding group"
    assert [o.result for o in results] == [[line], [line]]


@pytest.mark.parametrize("P", [2, 4])
def test_each_v_stage_of_a_hybrid_pattern_is_what_megatron_core_selects_on_its_rank(P, monkeypatch):
    # Megatron-Core's own selection (segment, layer offset), on each rank at each virtual stage, of the pattern
    # dualpipev_chunks hands it: the V's stage with the layers before it counted. Stage s has s + 1 layers here.
    import torch.distributed as dist
    from megatron.core.models.hybrid.hybrid_layer_allocation import select_pipeline_segment

    from megatron.bridge.training.ep_overlap.mcore.dualpipev_chunks import hybrid_stage_pattern
    from megatron.bridge.training.ep_overlap.program.dualpipev import stage_of

    stages = ["ME-*"[s % 4] * (s + 1) for s in range(2 * P)]
    pattern = "|".join(stages) + "/*E"
    quiet = SimpleNamespace(rank=lambda: 1)  # no logging rank
    for rank in range(P):
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_rank", lambda group=None, rank=rank: rank)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: P)
        for v in (0, 1):
            stage = stage_of(rank, v, P)
            rank_pattern = hybrid_stage_pattern(pattern, stage, P, rank)
            assert rank_pattern.endswith("/*E")
            main = rank_pattern.partition("/")[0]
            layers, offset = select_pipeline_segment(main, object(), v, tp_group=quiet, dp_cp_group=quiet)
            assert ("".join(layers), offset) == (stages[stage], sum(map(len, stages[:stage]))), (rank, stage)


def test_a_hybrid_pattern_without_2p_segments_is_refused_before_building(monkeypatch):
    from megatron.core import parallel_state

    from megatron.bridge.training.ep_overlap.mcore.dualpipev_chunks import dualpipev_chunks

    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: 0)
    built = []
    with pytest.raises(ValueError, match=r"^DualPipeV builds hybrid_layer_pattern='ME\|\*E' as 2 x 2 = 4 stages"):
        dualpipev_chunks(lambda **chunk: built.append(chunk), SimpleNamespace(mtp_num_layers=None), "ME|*E")
    assert built == []


# name: (the config's pipeline split, the line that refuses it before building).
BUILD_REFUSED = {
    "layout-mtp-on-rank-1": (
        {"pipeline_model_parallel_layout": "Et|ttt|m|L"},  # stage 2 is on rank 1
        "DualPipeV runs MTP beside the loss on stage 3 (pipeline rank 0, with the embedding), and "
        "pipeline_model_parallel_layout='Et|ttt|m|L' puts it on stage 2; fix: ",
    ),
    "layout-of-1f1b": (
        {"pipeline_model_parallel_layout": "Ettt|tmL"},
        "DualPipeV reads pipeline_model_parallel_layout='Ettt|tmL' as its 2 x 2 = 4 stages",
    ),
    "layout-empty-stage": (
        {"pipeline_model_parallel_layout": "E|ttt||tmL"},
        "DualPipeV does not run an empty stage (a chunk without parameters) yet, and "
        "pipeline_model_parallel_layout='E|ttt||tmL' leaves stage 2 empty; fix: ",
    ),
    # Megatron-Core would give it to interleaved pipeline rank 0: the V's stages 0 (rank 0) and 2 (rank 1).
    "first-stage-layers": (
        {"num_layers_in_first_pipeline_stage": 2},
        "DualPipeV does not read num_layers_in_first_pipeline_stage=2: Megatron-Core gives it to the interleaved "
        "layout's pipeline rank 0, whose chunks are the V's stages 0 and 2, not to one V rank; fix: ",
    ),
}


@pytest.mark.parametrize("name", sorted(BUILD_REFUSED))
def test_a_pipeline_split_the_v_cannot_run_is_refused_before_building(name, monkeypatch):
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    from megatron.bridge.training.ep_overlap.mcore.dualpipev_chunks import dualpipev_chunks

    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: 1)
    monkeypatch.setattr(parallel_state, "set_pipeline_model_parallel_rank", lambda rank: None)
    monkeypatch.setattr(parallel_state, "is_rank_in_embedding_group", lambda: False)  # rank 1: the V's group is 0's
    monkeypatch.setattr(ProcessGroupCollection, "use_mpu_process_groups", lambda: SimpleNamespace(pp=None))
    fields, line = BUILD_REFUSED[name]
    config = SimpleNamespace(mtp_num_layers=1, **fields)
    if layout := fields.get("pipeline_model_parallel_layout"):  # as TransformerConfig parses it
        config.pipeline_model_parallel_layout = PipelineParallelLayerLayout(layout, 2)
    built = []
    with pytest.raises(ValueError) as refused:
        dualpipev_chunks(lambda **chunk: built.append(chunk), config)
    assert str(refused.value).startswith(line) and "\n" not in str(refused.value)
    assert built == []


def _built_with_default_embedding_group(rank: int, world: int) -> list[str]:
    install_cpu_stubs()
    init_megatron(1, PP, 2)
    from megatron.bridge.training.ep_overlap.mcore.dualpipev_chunks import dualpipev_chunks

    built = []
    try:
        dualpipev_chunks(lambda **chunk: built.append(chunk), SimpleNamespace(mtp_num_layers=1))
    except ValueError as error:
        return [line.split(" (")[0] for line in str(error).splitlines()] + built
    return ["built"]


def _refused(rank: int, world: int, microbatches: int, config_fields: dict, chunk_fields: dict) -> str:
    install_cpu_stubs()
    init_megatron(CASE.world, PP, 2)
    from megatron.bridge.training.ep_overlap.mcore import get_forward_backward_func

    models = dualpipev_models(CASE, PP)[: chunk_fields.pop("chunks", 2)]
    for name, value in config_fields.items():
        if name == "pipeline_model_parallel_layout":  # as TransformerConfig parses it
            from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

            value = PipelineParallelLayerLayout(value, PP)
        setattr(models[0].config, name, value)
    for model in models:
        for name, value in chunk_fields.items():
            setattr(model, name, value)
    models[0].config.ep_overlap_pipeline_schedule = "dualpipev"
    data = _step_data(0, 0, microbatches)
    try:
        get_forward_backward_func(pp_size=PP, vp_size=2)(
            forward_step_func=bridge_style_forward_step, data_iterator=[iter(data), iter(data)], model=models,
            num_microbatches=microbatches, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
        )  # fmt: skip
    except ValueError as error:
        return str(error)
    return "ran"
