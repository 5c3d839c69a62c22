"""Megatron-Core's own driver (``forward_backward_no_pipelining``) running this project's layer schedule.

The overlapped arm installs the plan with the Bridge pre-wrap hook and turns ``overlap_moe_expert_parallel_comm``
on, so Megatron-Core's ``combined_1f1b`` calls ``EPOverlapSchedulePlan.run``; the plain arm is Megatron-Core's
ordinary forward/backward. The forward step is written as Megatron-Bridge's is (``build_schedule_plan`` with
tokens, positions, mask, labels and loss mask; a masked token-sum loss). Losses and gradients must match bitwise.
"""

from dataclasses import replace
from datetime import timedelta
from functools import partial

import pytest
import torch

from .bitwise import assert_steps_bitwise
from .fake_deepep import CALLS as FUSED_CALLS
from .fake_deepep import install_fake_deepep
from .local_ranks import run_local_ranks
from .mcore_cpu import init_megatron, install_cpu_stubs
from .mcore_models import HybridCase, McoreCase, build_gpt, build_model

SEQ, MICRO_BATCH = 8, 2


def masked_token_loss(loss_mask_BS: torch.Tensor, per_token_BS: torch.Tensor):
    """Megatron-Bridge's ``masked_next_token_loss`` shape: (token-summed loss, token count, what to log)."""
    losses = per_token_BS.view(-1).float()
    mask = loss_mask_BS.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def bridge_style_forward_step(data_iterator, model, return_schedule_plan: bool = False):
    tokens, labels = next(data_iterator)
    loss_mask = (labels % 5 != 0).float()  # some tokens do not count
    position_ids = torch.arange(SEQ, device=tokens.device)[None].expand_as(tokens)
    attention_mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool, device=tokens.device), diagonal=1)[None, None]
    loss_func = partial(masked_token_loss, loss_mask)
    if return_schedule_plan:
        plan = model.build_schedule_plan(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
        return plan, loss_func
    output = model(
        input_ids=tokens, position_ids=position_ids, attention_mask=attention_mask, labels=labels, loss_mask=loss_mask
    )
    return output, loss_func


def train_with_mcore_driver(rank: int, world: int, case: McoreCase) -> dict:
    install_cpu_stubs()
    if case.dispatcher == "flex":
        install_fake_deepep()
    init_megatron(world)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron.bridge.training.ep_overlap.mcore import use_ep_overlap_schedule

    rebuilt, routed = count_norm_recomputes(), count_routes()
    out = {}
    for arm in ("plain", "overlap"):
        rebuilt.clear(), routed.clear()
        model = build_model(case, overlap_flag=arm == "overlap" and case.bf16)
        if arm == "overlap":
            model.config.overlap_moe_expert_parallel_comm = True  # fp32: Megatron-Core's config refuses it at build
            use_ep_overlap_schedule([model], timeout=timedelta(seconds=30))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses, grads, phases = [], [], []
        FUSED_CALLS.clear()
        for step in range(case.steps):
            gen = torch.Generator().manual_seed(100 * step + rank)
            data = [
                tuple(torch.randint(0, 64, (2, MICRO_BATCH, SEQ), generator=gen)) for _ in range(case.microbatches)
            ]
            store = get_forward_backward_func()(
                forward_step_func=bridge_style_forward_step,
                data_iterator=iter(data),
                model=[model],
                num_microbatches=case.microbatches,
                seq_length=SEQ,
                micro_batch_size=MICRO_BATCH,
                forward_only=False,
            )
            losses.append(torch.stack([logged["lm loss"] for logged in store]))
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            if arm == "overlap":
                recorder = model.build_schedule_plan.recorder
                phases.append(sorted({(r.phase, r.microbatch) for r in recorder.comm if r.op == "dispatch"}))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        out[arm] = {
            "losses": losses,
            "grads": grads,
            "phases": phases,
            "fused_calls": dict(FUSED_CALLS),
            "norm_recomputes": len(rebuilt),
            "routes": len(routed),
        }
    return out


def count_routes() -> list:
    """Each MoE layer's routing of a microbatch (twice with 'moe' recomputed) appends to the list returned."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    routed, route = [], MoELayer.route

    def counted(self, *args, **kwargs):
        routed.append(self.layer_number)
        return route(self, *args, **kwargs)

    MoELayer.route = counted
    return routed


def count_norm_recomputes() -> list:
    """Each rebuild of a dropped norm output (``recompute_modules=['layernorm']``) appends to the list returned."""
    from megatron.core.tensor_parallel.random import CheckpointWithoutOutput

    rebuilt, recompute = [], CheckpointWithoutOutput._recompute

    def counted(self, grad):
        rebuilt.append(self.ctx is not None)
        return recompute(self, grad)

    CheckpointWithoutOutput._recompute = counted
    return rebuilt


CASES = {
    "ep2-fp32-top2": McoreCase(microbatches=3),
    "ep2-bf16-top2-flag-at-build": McoreCase(bf16=True, microbatches=3),
    "ep2-fp32-top1-mixed-rope": McoreCase(topk=1, layer_freq=(1, 0), rope=True, microbatches=2),
    "ep2-fp32-one-microbatch": McoreCase(microbatches=1),
    "ep2-fp32-tied-embeddings": McoreCase(tied=True, microbatches=4),
    # One MTP layer in the head; Megatron-Core's forward_step sets its loss scale in both arms.
    "ep2-fp32-mtp": McoreCase(mtp=True, microbatches=3),
    "ep2-bf16-mtp-tied-rope": McoreCase(mtp=True, tied=True, rope=True, bf16=True, microbatches=3),
    # HybridModel: the hook gives it the same instance-level build_schedule_plan; units are MoE groups.
    "hybrid-*E*E": HybridCase(pattern="*E*E", microbatches=3),
    "hybrid-E-*E*-top1-rope": HybridCase(pattern="E-*E*-", topk=1, rope=True, microbatches=3),
    "hybrid-*E*E/*E-mtp": HybridCase(pattern="*E*E/*E", microbatches=3),
    # The flex dispatcher (DeepEP's contract on gloo, tests' fake_deepep): the backend's fused comm in our comm nodes.
    "ep2-bf16-top2-flex-flag-at-build": McoreCase(dispatcher="flex", bf16=True, microbatches=3),
    "ep2-fp32-deepseek-like": McoreCase(mla=True, expert_bias=True, mtp=True, dispatcher="flex", microbatches=3),
    "ep2-fp32-top2-hybridep": McoreCase(dispatcher="flex", flex_backend="hybridep", microbatches=3),
    "hybrid-+E-E-mla": HybridCase(pattern="+E-E", microbatches=3),
    "hybrid-*E-E-flex": HybridCase(pattern="*E-E", dispatcher="flex", microbatches=3),
    # Full recompute: Megatron-Core's plain path checkpoints its blocks; its driver runs our plan, which replays
    # (Megatron-Core 0.19's config refuses the overlap flag with full recompute at build; set after, as for fp32).
    # The norms' outputs dropped and rebuilt (layernorm recompute): the pre-MLP norm's across our nodes.
    "ep2-fp32-recompute-layernorm-shared": McoreCase(recompute=("layernorm",), shared_ffn=16, microbatches=3),
    # 'moe' recomputed: Megatron-Core checkpoints each MoE layer's MoE part; our plan replays it in backward, from
    # the random states of its first forward (forced load balancing draws the router's logits).
    "ep2-fp32-recompute-moe-layernorm-shared": McoreCase(
        recompute=("moe", "layernorm"),
        shared_ffn=16,
        layer_freq=(1, 0, 1),
        microbatches=3,
        config=(("moe_router_force_load_balancing", True),),
    ),  # fmt: skip
    "ep2-fp32-full-uniform1": McoreCase(microbatches=3, full_recompute=("uniform", 1)),
    "hybrid-*E-E-recompute-moe": HybridCase(pattern="*E-E", microbatches=3, recompute=("moe",)),
    "hybrid-*E*E/*E-mtp-full-uniform1": HybridCase(pattern="*E*E/*E", microbatches=3, full_recompute=("uniform", 1)),
}


WIDE_CASES = {"hybrid-*E-E-recompute-moe"}  # a second model for a path CI runs once


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=pytest.mark.wide if name in WIDE_CASES else ()) for name in sorted(CASES)]
)
def test_megatron_core_driver_runs_our_schedule_bitwise_equal(name):
    case = CASES[name]
    for outcome in run_local_ranks(train_with_mcore_driver, case.world, (case,)):
        plain, overlap = outcome.result["plain"], outcome.result["overlap"]
        assert_steps_bitwise(plain, overlap, case.steps, outcome.rank)
        for step in range(case.steps):
            # Our lane ran every dispatch, in Megatron-Core's order: microbatch 0 alone, the rest paired.
            n = case.microbatches
            assert overlap["phases"][step] == sorted([("warmup", 0), *(("paired", i) for i in range(1, n))])
        assert any("experts" in n and g.abs().sum() > 0 for n, g in plain["grads"][-1].items())
        # A flex backend's fused functions ran as often as in the plain path (once per layer and microbatch each).
        assert overlap["fused_calls"] == plain["fused_calls"]
        assert bool(plain["fused_calls"]) == (case.dispatcher == "flex")
        # Each dropped norm output rebuilt once per layer and microbatch, in our nodes as in the plain path.
        assert overlap["norm_recomputes"] == plain["norm_recomputes"]
        assert bool(plain["norm_recomputes"]) == ("layernorm" in case.recompute)
        # Each MoE layer routes each microbatch as often as in the plain path: twice where its MoE is recomputed.
        assert overlap["routes"] == plain["routes"]
        if "moe" in case.recompute:
            assert plain["routes"] == 2 * case.steps * case.microbatches * sum(case.layer_freq)


def refuse(rank: int, world: int, change: dict) -> str:
    install_cpu_stubs()
    init_megatron(world)
    from megatron.bridge.training.ep_overlap.mcore import use_ep_overlap_schedule

    model = build_gpt(replace(McoreCase(), **change.get("case", {})))
    for key, value in change.get("config", {}).items():
        setattr(model.config, key, value)
    for key, value in change.get("model", {}).items():
        setattr(model, key, value)  # what a pipeline stage's GPTModel has
    try:
        use_ep_overlap_schedule([model])
    except (ValueError, AssertionError) as error:
        return f"{type(error).__name__}: {error}"
    return "accepted"


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"config": {"delay_wgrad_compute": True, "moe_shared_expert_overlap": True}}, "moe_shared_expert_overlap"),
        ({"config": {"recompute_granularity": "full"}}, "recompute"),
        # this project's schedule replays full recompute, but not dropout's masks
        (
            {
                "config": {
                    "recompute_granularity": "full",
                    "recompute_method": "uniform",
                    "recompute_num_layers": 1,
                    "hidden_dropout": 0.1,
                }
            },
            "[full_recompute_dropout] model.hidden_dropout=0.1",
        ),  # fmt: skip
    ],
)
def test_hook_refuses_a_bad_config_before_any_step(change, expected):
    for outcome in run_local_ranks(refuse, 2, (change,)):
        assert outcome.result.startswith("CommOverlapConfigError") and expected in outcome.result, outcome.result


class _NotAMegatronModel(torch.nn.Module):
    """A model class the plan does not know, with what the hook reads of a model."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.proj = torch.nn.Linear(4, 4)


def refuse_models(rank: int, world: int, kinds: list[str]) -> dict[str, dict]:
    """Each kind's refusals (one model each, on the same ranks)."""
    install_cpu_stubs()
    init_megatron(world)
    return {kind: refuse_model(kind) for kind in kinds}


def refuse_model(kind: str) -> dict:
    from megatron.bridge.training.ep_overlap.mcore import McoreGPTChunk, chunk_for, use_ep_overlap_schedule

    from .mcore_models import build_hybrid

    if kind == "mrope":
        model, plan = build_gpt(McoreCase()), chunk_for
        model.position_embedding_type = "mrope"  # multimodal rotary positions
    elif kind == "hybrid-mtp-depths-unset":
        model, plan = build_hybrid(HybridCase(pattern="*E*E/*E")), chunk_for
        model.config.mtp_num_layers = None
    elif kind == "recompute-moe-graphed-router":
        model, plan = build_gpt(McoreCase()), chunk_for
        model.config.recompute_granularity, model.config.recompute_modules = "selective", ["moe", "core_attn"]
        model.config.cuda_graph_impl, model.config.cuda_graph_modules = "transformer_engine", ["moe_router"]
        for layer in model.decoder.layers:
            layer.mlp.moe_layer_recompute = True  # as the layer sets it when built with 'moe' recomputed
    elif kind == "full-recompute-mtp-uniform2":
        model, plan = build_gpt(McoreCase(mtp=True)), chunk_for
        model.config.recompute_granularity, model.config.recompute_method = "full", "uniform"
        model.config.recompute_num_layers = 2
    elif kind == "ncclep-zero-copy":
        install_fake_deepep()
        model, plan = build_gpt(McoreCase(dispatcher="flex")), chunk_for
        model.config.moe_flex_dispatcher_backend, model.config.moe_ncclep_zero_copy = "ncclep", True
    elif kind == "other":
        model, plan = _NotAMegatronModel(build_gpt(McoreCase()).config), chunk_for
    else:  # a HybridModel handed to the GPT plan by name
        model, plan = build_hybrid(HybridCase()), McoreGPTChunk
    builds = {"hook": lambda: use_ep_overlap_schedule([model]), "plan": lambda: plan(model)}
    if kind in ("hybrid-as-gpt", "recompute-moe-graphed-router", "full-recompute-mtp-uniform2"):
        # the hook picks the plan by class; its rules refuse graphs without TE and uniform 2 with MTP
        # first (test_parallel_layouts.py: on every rank of a pipeline)
        del builds["hook"]
    refused = {}
    for name, build in builds.items():
        try:
            build()
            refused[name] = "accepted"
        except ValueError as error:
            refused[name] = str(error)
    return refused


MODEL_REFUSALS = [
    ("mrope", "position_embedding_type='mrope': multimodal rotary positions (3 position ids per token) are not"),
    ("recompute-moe-graphed-router", "layer0: recompute_modules with 'moe' and cuda_graph_modules ['moe_router']"),
    ("hybrid-mtp-depths-unset", "hybrid_layer_pattern='*E*E/*E' has 1 multi-token prediction depth(s)"),
    ("other", "_NotAMegatronModel: the EP-overlap plan runs Megatron-Core's GPTModel and HybridModel"),
    ("ncclep-zero-copy", "layer0: moe_ncclep_zero_copy=True: NCCL EP's experts write into one receive buffer"),
    ("hybrid-as-gpt", "HybridModel: McoreGPTChunk runs Megatron-Core's GPTModel (whole or a pipeline chunk)"),
    # Megatron-Core's MTP layer checkpoints its depth as one segment only with recompute_num_layers=1
    ("full-recompute-mtp-uniform2", "recompute_num_layers=2 with recompute_method='uniform' and an MTP layer"),
]


@pytest.fixture(scope="module")
def model_refusals() -> list[dict[str, dict]]:
    """Per rank, each kind's refusals: all kinds on one pair of ranks."""
    return [o.result for o in run_local_ranks(refuse_models, 2, ([kind for kind, _ in MODEL_REFUSALS],))]


@pytest.mark.parametrize("kind, line", MODEL_REFUSALS)
def test_a_model_feature_the_plan_does_not_schedule_is_refused_when_the_hook_runs(model_refusals, kind, line):
    # Before MTP ran in the head, an MTP GPTModel ran under both with every MTP parameter getting no gradient.
    for refused in model_refusals:
        assert refused[kind], refused[kind]
        for result in refused[kind].values():
            assert result.startswith(line) and "fix: " in result, refused[kind]


def train_interleaved(rank: int, world: int, case: McoreCase, overlap_p2p_comm: bool) -> dict:
    """Megatron-Core's interleaved schedule (PP 2 x VPP 2 x EP 2): plain, and combined 1F1B running our plan."""
    install_cpu_stubs()
    if case.dispatcher == "flex":
        install_fake_deepep()
    init_megatron(case.world, 2, 2)
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron.bridge.training.ep_overlap.mcore import use_ep_overlap_schedule

    from .mcore_stages import build_plans

    out = {}
    for arm in ("plain", "overlap"):
        models = [plan.model for plan in build_plans(case, 2, 2)]
        config = models[0].config  # shared by the chunks
        # gloo matches P2P in posting order; Megatron-Core's batched P2P sends both directions of a 2-stage
        # pipeline on one group, which only NCCL's group semantics keep apart.
        config.batch_p2p_comm, config.overlap_p2p_comm = False, overlap_p2p_comm
        if arm == "overlap":
            config.overlap_moe_expert_parallel_comm = True
            use_ep_overlap_schedule(models, timeout=timedelta(seconds=30))
        optimizer = torch.optim.Adam([p for m in models for p in m.parameters()], lr=1e-2)
        named = [(f"chunk{v}.{n}", p) for v, m in enumerate(models) for n, p in m.named_parameters()]
        losses, grads = [], []
        for step in range(case.steps):
            gen = torch.Generator().manual_seed(100 * step + parallel_state.get_data_parallel_rank())
            data = [
                tuple(torch.randint(0, 64, (2, MICRO_BATCH, SEQ), generator=gen)) for _ in range(case.microbatches)
            ]
            store = get_forward_backward_func()(
                forward_step_func=bridge_style_forward_step,
                data_iterator=[iter(data), iter(list(data))],  # one per chunk, as Megatron-Core wants
                model=models,
                num_microbatches=case.microbatches,
                seq_length=SEQ,
                micro_batch_size=MICRO_BATCH,
                forward_only=False,
            )
            losses.append(torch.stack([logged["lm loss"] for logged in store]) if store else None)
            grads.append({n: p.grad.clone() for n, p in named if p.grad is not None})
            if arm == "overlap":  # our lane ran the all-to-alls, some of them in paired steps
                phases = {r.phase for r in models[0].build_schedule_plan.recorder.comm if r.op == "dispatch"}
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        out[arm] = {"losses": losses, "grads": grads, "phases": phases if arm == "overlap" else None}
    return out


LAST_STAGE, MTP_STAGE = ["decoder", "mtp", "loss"], ["mtp", "loss"]
INTERLEAVED = {  # Megatron-Core refuses N = 5 here
    "gpt": McoreCase(layer_freq=(1, 0, 1, 1), microbatches=4, steps=2),
    "hybrid": HybridCase(pattern="*E|E-|*-E|E*", microbatches=4, steps=2),
    "hybrid-flex": HybridCase(pattern="*E|E-|*-E|E*", microbatches=4, steps=2, dispatcher="flex"),
    # One MTP layer on the last stage (with its copy of the embedding), RoPE on chunks without the embedding.
    "gpt-mtp-rope": McoreCase(layer_freq=(1, 0, 1, 1), microbatches=4, steps=2, mtp=True, rope=True),
    "gpt-tied": McoreCase(layer_freq=(1, 0, 1, 1), microbatches=4, steps=2, tied=True),
    "gpt-mla-mtp-flex": McoreCase(
        layer_freq=(1, 0, 1, 1), microbatches=4, steps=2, mla=True, mtp=True, dispatcher="flex"
    ),
    "hybrid-mtp": HybridCase(pattern="*E|E-|*-E|E*/*E", microbatches=4, steps=2, rope=True),
    "gpt-mtp-full-uniform1": McoreCase(
        layer_freq=(1, 0, 1, 1), microbatches=4, steps=2, mtp=True, full_recompute=("uniform", 1)
    ),
    "hybrid-full-uniform1": HybridCase(pattern="*E|E-|*-E|E*", microbatches=4, steps=2, full_recompute=("uniform", 1)),
    # DeepSeek-V3's kind of layout over virtual stages (virtual-stage-major): uneven, MTP beside the loss.
    "gpt-layout-mtp-rope": McoreCase(
        layer_freq=(0, 1, 1, 1),
        microbatches=4,
        steps=2,
        mtp=True,
        rope=True,
        config=(("pipeline_model_parallel_layout", [["embedding", "decoder"], ["decoder"], ["decoder"], LAST_STAGE]),),
    ),
    # The last virtual stage holds only MTP and the loss (DeepSeek-V3's 1,024-GPU H100 layout, shrunk): the final
    # norm ends the stage before it.
    "gpt-layout-mtp-stage": McoreCase(
        layer_freq=(0, 1, 1),
        microbatches=4,
        steps=2,
        mtp=True,
        rope=True,
        config=(("pipeline_model_parallel_layout", [["embedding", "decoder"], ["decoder"], ["decoder"], MTP_STAGE]),),
    ),
}


# Every model with Megatron-Core's P2P hooks (overlap_p2p_comm); the driver moving the tensors itself, for the two
# model classes (the rest behind -m wide: that path does not depend on the model's features).
BOTH_P2P = ("gpt", "hybrid")


@pytest.mark.parametrize(
    "overlap_p2p_comm, model",
    [(True, name) for name in sorted(INTERLEAVED)]
    + [
        pytest.param(False, name, marks=() if name in BOTH_P2P else pytest.mark.wide, id=f"False-{name}")
        for name in sorted(INTERLEAVED)
    ],
    ids=lambda value: str(value),
)
def test_megatron_core_interleaved_driver_runs_our_schedule_bitwise_equal(overlap_p2p_comm, model):
    # With overlap_p2p_comm Megatron-Core hands the plan its P2P hooks; without, it moves tensors between steps.
    case = INTERLEAVED[model]
    for outcome in run_local_ranks(train_interleaved, 4, (case, overlap_p2p_comm)):
        plain, overlap = outcome.result["plain"], outcome.result["overlap"]
        assert all((losses is None) == (outcome.rank < 2) for losses in plain["losses"])  # the last stage's only
        assert_steps_bitwise(plain, overlap, case.steps, outcome.rank)
        assert "paired" in overlap["phases"]


@pytest.mark.wide
@pytest.mark.parametrize("modules", [("layernorm",), ("moe", "layernorm")], ids="-".join)
def test_selective_recompute_under_megatron_cores_interleaved_driver_is_bitwise_equal(modules):
    case = McoreCase(layer_freq=(1, 0, 1, 1), microbatches=4, steps=2, recompute=modules, shared_ffn=16)
    for outcome in run_local_ranks(train_interleaved, 4, (case, True)):
        assert_steps_bitwise(outcome.result["plain"], outcome.result["overlap"], case.steps, outcome.rank)
        assert "paired" in outcome.result["overlap"]["phases"]


def build_with(rank: int, world: int, argument: str) -> str:
    install_cpu_stubs()
    init_megatron(world)
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron.bridge.training.ep_overlap.mcore import use_ep_overlap_schedule

    model = build_gpt(McoreCase())
    model.config.overlap_moe_expert_parallel_comm = True
    use_ep_overlap_schedule([model], timeout=timedelta(seconds=30))
    tokens = torch.zeros(MICRO_BATCH, SEQ, dtype=torch.long)
    extra = {
        "packed_seq_params": PackedSeqParams(qkv_format="thd"),  # but two rows: packed microbatches have one
        "packed_seq_params_sbhd": PackedSeqParams(qkv_format="sbhd"),
        "decoder_input": torch.zeros(SEQ, MICRO_BATCH, 32),
        "padding_mask": torch.zeros(MICRO_BATCH, SEQ, dtype=torch.bool),  # as Megatron-Bridge main passes it
    }[argument]
    try:
        model.build_schedule_plan(tokens, None, None, labels=tokens, **{argument.removesuffix("_sbhd"): extra})
    except ValueError as error:
        return str(error)
    return "accepted"


@pytest.mark.parametrize(
    "argument, line",
    [
        ("packed_seq_params", "packed_seq_params: input_ids of 2 rows: a packed (THD) microbatch is one row"),
        ("packed_seq_params_sbhd", "packed_seq_params: qkv_format='sbhd': the plan runs packed microbatches in the"),
        ("decoder_input", "decoder_input: the plan embeds input_ids on the first chunk"),
        ("padding_mask", "padding_mask: padded tokens would still be routed and counted"),
    ],
)
def test_a_microbatch_the_plan_cannot_run_is_refused_before_it_runs(argument, line):
    # build_schedule_plan binds a microbatch and runs nothing, so the refusal comes before any of the step's compute.
    for outcome in run_local_ranks(build_with, 2, (argument,)):
        assert outcome.result.startswith(f"EP-overlap build_schedule_plan: {line}"), outcome.result
        assert "; fix: " in outcome.result


def build_packed_like(rank: int, world: int) -> dict:
    """One row whose position ids restart inside it (two documents), built as Megatron-Bridge 0.6.2's forward steps
    build it (no ``packed_seq_params`` keyword), with the keyword given as None, and a padded row."""
    install_cpu_stubs()
    init_megatron(world)
    from megatron.bridge.training.ep_overlap.mcore import use_ep_overlap_schedule

    model = build_gpt(McoreCase())
    model.config.overlap_moe_expert_parallel_comm = True
    use_ep_overlap_schedule([model], timeout=timedelta(seconds=30))
    tokens = torch.zeros(1, SEQ, dtype=torch.long)
    packed, padded = torch.cat([torch.arange(5), torch.arange(SEQ - 5)])[None], torch.arange(SEQ)[None]
    out = {}
    for name, positions, keyword in (
        ("dropped", packed, {}),
        ("said_none", packed, {"packed_seq_params": None}),
        ("padded", padded, {}),
    ):
        try:
            model.build_schedule_plan(tokens, positions, None, labels=tokens, **keyword)
            out[name] = "accepted"
        except ValueError as error:
            out[name] = str(error)
    return out


def test_a_packed_microbatch_built_without_its_parameters_is_refused_from_what_the_builder_is_given():
    # No frame of Megatron-Bridge's is on the stack here: the builder decides from its arguments (packed_guard.py).
    for outcome in run_local_ranks(build_packed_like, 2):
        dropped = outcome.result["dropped"]
        assert dropped.startswith("EP-overlap build_schedule_plan: packed_seq_params: this microbatch's position ids")
        assert "Megatron-Bridge's gpt_step forward step (0.6.2, unpatched)" in dropped
        assert outcome.result["said_none"] == "accepted" and outcome.result["padded"] == "accepted"


def resolved_settings(rank: int, world: int) -> dict:
    """What the hook and the engine read from ``Settings``: the window where the options say None, and the
    dispatcher's kind (an allgather dispatcher's model is built; the rules refuse it where the overlap runs)."""
    install_cpu_stubs()
    init_megatron(world)
    from ep_overlap_lab.engine import EPOverlapEngine
    from megatron.bridge.training.ep_overlap.mcore import chunk_for, mcore_ep_groups, use_ep_overlap_schedule

    out = {}
    for delay in (False, True):
        model = build_gpt(McoreCase())
        model.config.overlap_moe_expert_parallel_comm, model.config.delay_wgrad_compute = True, delay
        try:
            use_ep_overlap_schedule([model], timeout=timedelta(seconds=30), attention_wgrad_window=None)
            out[f"window_none_delay_{delay}"] = model.build_schedule_plan.settings.attention_wgrad_window
        except ValueError as error:
            out[f"window_none_delay_{delay}"] = str(error)
    groups = mcore_ep_groups(timedelta(seconds=30))
    install_fake_deepep()
    out["flex_owns_comm"] = [layer.owns_comm for layer in chunk_for(build_gpt(McoreCase(dispatcher="flex"))).layers]
    allgather = chunk_for(build_gpt(McoreCase(dispatcher="allgather")))  # the plan no longer refuses it itself
    out["allgather_owns_comm"] = [layer.owns_comm for layer in allgather.layers]
    try:
        EPOverlapEngine(allgather, groups, overlap=True)
    except ValueError as error:
        out["allgather_engine"] = str(error)
    return out


@pytest.mark.lab
def test_the_hook_and_the_plan_read_the_window_and_the_dispatcher_from_settings():
    for outcome in run_local_ranks(resolved_settings, 2):
        result = outcome.result
        # Without delayed wgrad there is no window to place: None is window 1 (as in EPOverlapEngine); the hook
        # refused it before, though its reason (the planner cannot choose under Megatron-Core's driver) needs one.
        assert result["window_none_delay_False"] == 1
        assert result["window_none_delay_True"].startswith(
            "attention_wgrad_window=None (auto): Megatron-Core's driver runs every step overlapped"
        )
        assert result["flex_owns_comm"] == [True, True] and result["allgather_owns_comm"] == [False, False]
        # The one refusal of the dispatcher is the rules' line.
        lines = result["allgather_engine"].splitlines()
        assert lines[0] == "communication overlap config has 1 problem:", lines
        assert lines[1].startswith("  - [token_dispatcher] model.moe_token_dispatcher_type='allgather'"), lines


def _disagreeing_counts(rank: int, world: int, announced: bool = False) -> dict:
    import time

    install_cpu_stubs()
    init_megatron(world)
    if announced:  # this package's function announces the count: agreed once, at the step's first plan
        from megatron.bridge.training.ep_overlap.mcore import get_forward_backward_func
    else:  # Megatron-Core's, with no num-microbatches calculator: nothing says the count, agreed per driver call
        from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron.bridge.training.ep_overlap.mcore import use_ep_overlap_schedule

    model = build_model(McoreCase(microbatches=3))
    model.config.overlap_moe_expert_parallel_comm = True
    use_ep_overlap_schedule([model], timeout=timedelta(seconds=60))
    count = 3 + rank  # rank 1 was given one microbatch more
    gen = torch.Generator().manual_seed(rank)
    data = [tuple(torch.randint(0, 64, (2, MICRO_BATCH, SEQ), generator=gen)) for _ in range(count)]
    start = time.monotonic()
    try:
        get_forward_backward_func()(
            forward_step_func=bridge_style_forward_step, data_iterator=iter(data), model=[model],
            num_microbatches=count, seq_length=SEQ, micro_batch_size=MICRO_BATCH, forward_only=False,
        )  # fmt: skip
        return {"error": None}
    except RuntimeError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}


def test_ranks_given_different_microbatch_counts_fail_together_at_the_first_plan_naming_the_counts():
    for outcome in run_local_ranks(_disagreeing_counts, 2, (True,)):
        error = outcome.result["error"]
        assert error is not None and "were given different microbatch counts" in error, error
        named = "(their all-to-alls pair step by step; counts from the forward-backward call): rank 0: 3, rank 1: 4"
        assert named in error, error
        assert outcome.result["seconds"] < 30


def _host_collectives_per_step(rank: int, world: int, announced: bool) -> list[int]:
    """The agreement's host collectives in each of 2 steps of 3 microbatches (PP 1: F, F+B, F+B, B: 4 calls)."""
    install_cpu_stubs()
    init_megatron(world)
    from megatron.core import pipeline_parallel

    from megatron.bridge.training.ep_overlap.mcore import get_forward_backward_func, use_ep_overlap_schedule

    model = build_model(McoreCase(microbatches=3))
    model.config.overlap_moe_expert_parallel_comm = True
    use_ep_overlap_schedule([model], timeout=timedelta(seconds=60))
    agreement = model.build_schedule_plan.session.agreement
    schedule = get_forward_backward_func() if announced else pipeline_parallel.get_forward_backward_func()
    counts = []
    for step in range(2):
        gen = torch.Generator().manual_seed(10 * step + rank)
        data = [tuple(torch.randint(0, 64, (2, MICRO_BATCH, SEQ), generator=gen)) for _ in range(3)]
        before = agreement.collectives
        schedule(
            forward_step_func=bridge_style_forward_step, data_iterator=iter(data), model=[model],
            num_microbatches=3, seq_length=SEQ, micro_batch_size=MICRO_BATCH, forward_only=False,
        )  # fmt: skip
        counts.append(agreement.collectives - before)
    return counts


@pytest.mark.parametrize("announced, per_step", [(True, 1), (False, 4)], ids=["count-known", "count-unknown"])
def test_the_agreement_costs_one_host_collective_per_step_where_the_count_is_known(announced, per_step):
    # Known (this package's get_forward_backward_func, or Megatron-Core's calculator): once, at the step's first
    # plan. Unknown (Megatron-Core's function called directly, no calculator): once per driver call, N + 1 at PP 1.
    for outcome in run_local_ranks(_host_collectives_per_step, 2, (announced,)):
        assert outcome.result == [per_step, per_step], outcome.result


def test_ranks_given_different_microbatch_counts_fail_together_naming_the_counts():
    for outcome in run_local_ranks(_disagreeing_counts, 2):
        error = outcome.result["error"]
        assert error is not None and "were given different microbatch counts" in error, error
        assert "rank 0 ran its last backward, of microbatch 2 (3 microbatches)" in error
        assert "rank 1 is at a paired step (forward of microbatch 3 with the backward of microbatch 2)" in error
        assert outcome.result["seconds"] < 30  # at once, not after the collective timeout (60 s here)
