"""Megatron-Bridge 0.6.2's newer MoE families under Megatron-Core's driver with this project's plan: each family's
layer features bitwise equal to the plain path, or refused by name when the plan is built.

What each provider sets, read from ``megatron/bridge/models/`` and built from the published configs
(``tests/functional_tests/hf_configs``), and where it is covered:

    GLM-5, GLM-5.1 (glm_moe_dsa)  GPTModel: MLA with DeepSeek sparse attention (an indexer picking each query's top-k
                                  keys, trained by its own KL loss), sigmoid router with expert bias, sequence aux
                                  loss, a shared expert, dense first layers: ``glm5-dsa`` (and full recompute
                                  replaying it: ``glm5-dsa-full-uniform1``)
    GLM-5.2                       the same with top-k sharing (``dsa_indexer_topk_freq`` 4: a layer reuses an earlier
                                  layer's top-k): ``glm5.2-dsa-shared-topk``, with no attention mask (the holder
                                  is then on the config, shared by the microbatches); with full recompute: refused
                                  (``dsa_topk_sharing_recompute``)
    Kimi-K2 (kimi_k2)             GPTModel: MLA, sigmoid router with expert bias, sequence aux loss, a shared expert, a
                                  dense first layer: ``kimi-k2``. Kimi-K2.5 (``KimiK25VLModel``): refused
                                  (``config_refusals``' ``model_class``; ``chunk_for`` when built)
    MiniMax-M3 text               GPTModel: zero-centered RMSNorm, query/key norms, partial rotary (half), quick-GELU
                                  GLU clamped with offset, fp32 routers with expert bias and aux loss, a shared
                                  expert, HybridEP: ``minimax-m3`` (bf16). The VL provider (``MiniMaxM3VLModel``):
                                  refused (``model_class``). Its lightning-indexer layers are checkpoint-only weights
                                  outside the language model (Megatron-Core runs full attention there).
    K-EXAONE (exaone_moe)         GPTModel: sliding-window layers and NoPE global layers (per-layer lists), query/key
                                  norms, group-limited sigmoid routing with expert bias, global aux loss and z-loss,
                                  a shared expert, a dense first layer, MTP: ``k-exaone``
    Nemotron-3 Super, Ultra       HybridModel: Mamba, attention, latent MoE (``moe_latent_size``: projections into
                                  and out of a smaller expert width around the dispatch), a shared expert, one MTP
                                  depth ``*E``: ``nemotron3-latent-moe``; with delayed wgrad (the projections'
                                  weight gradients deferred): ``nemotron3-latent-moe-delayed-wgrad``
    DeepSeek-V4 Flash, Pro        refused: ``hyper_connections``, ``hash_routing``, ``attention_variant``
                                  (``dsv4_hybrid``); none of them is in Megatron-Core 0.19

Transformer Engine-only modules run as test-only stand-ins (``family_models.py``); both arms build the same modules.
Two CPU ranks (EP 2), 2 Adam steps per arm, losses and every gradient bitwise.
"""

from functools import partial
from types import SimpleNamespace

import pytest
import torch

from .bitwise import assert_steps_bitwise
from .family_models import DSA_FIELDS, build_dsa_gpt, build_minimax_like, install_latent_projections, minimax_fields
from .local_ranks import run_local_ranks
from .mcore_arms import train_plain_and_hook
from .mcore_cpu import init_megatron, install_cpu_stubs
from .mcore_models import HybridCase, McoreCase, build_model, install_kernels_for
from .test_mcore_hook import SEQ, bridge_style_forward_step, masked_token_loss, train_with_mcore_driver


def unmasked_forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """Megatron-Bridge's GPT step where the dataset makes no attention mask (the attention is causal by its type)."""
    tokens, labels = next(data_iterator)
    loss_mask = (labels % 5 != 0).float()
    position_ids = torch.arange(SEQ, device=tokens.device)[None].expand_as(tokens)
    loss_func = partial(masked_token_loss, loss_mask)
    if return_schedule_plan:
        return model.build_schedule_plan(tokens, position_ids, None, labels=labels, loss_mask=loss_mask), loss_func
    output = model(
        input_ids=tokens, position_ids=position_ids, attention_mask=None, labels=labels, loss_mask=loss_mask
    )
    return output, loss_func


STEPS = {"masked": bridge_style_forward_step, "unmasked": unmasked_forward_step}
SHARED = ("moe_shared_expert_intermediate_size", 16)
ROUTER = (("moe_router_score_function", "sigmoid"), ("moe_router_enable_expert_bias", True))
TOPK_SHARING = (("dsa_indexer_topk_freq", 2), ("dsa_indexer_skip_topk_offset", 1))
KIMI_K2 = (
    ("normalization", "RMSNorm"),
    ("qk_layernorm", True),
    ("moe_router_load_balancing_type", "seq_aux_loss"),
    ("moe_aux_loss_coeff", 0.001),
    ("moe_router_topk_scaling_factor", 2.827),
    ("moe_router_dtype", "fp32"),
)
# K-EXAONE's provider (ExaoneMoeBridge.provider_bridge): three sliding-window layers with RoPE, then a global one
# without; group-limited routing (2 groups here, 1 picked), global aux loss and z-loss (the provider's defaults).
K_EXAONE = (
    ("normalization", "RMSNorm"),
    ("qk_layernorm", True),
    ("window_size", (3, 0)),
    ("window_attn_skip_freq", [1, 1, 1, 0]),
    ("no_rope_freq", [0, 0, 0, 1]),
    ("moe_router_num_groups", 2),
    ("moe_router_group_topk", 1),
    ("moe_router_topk_scaling_factor", 2.5),
    ("moe_router_dtype", "fp32"),
)
# Nemotron-3 Super's provider (NemotronHBridge.provider_bridge, the published config): latent MoE with a shared expert
# outside the latent width, sigmoid routing with expert bias and sequence aux loss, MTP depth '*E' (its one layer
# repeated).
NEMOTRON3 = (
    ("moe_latent_size", 16),
    SHARED,
    ("normalization", "RMSNorm"),
    *ROUTER,
    ("moe_router_load_balancing_type", "seq_aux_loss"),
    ("moe_aux_loss_coeff", 0.0001),
    ("mtp_use_repeated_layer", True),
)

# name -> (case, what builds it: "dsa", "minimax" or None for mcore_models' builder, the forward step)
CASES = {
    "glm5-dsa": (
        McoreCase(mla=True, layer_freq=(0, 1, 1), shared_ffn=16, microbatches=3, config=DSA_FIELDS + ROUTER),
        "dsa",
        "masked",
    ),
    # Delayed wgrad: the indexer's linears defer theirs too (Megatron-Core's attention backward_dw leaves them).
    "glm5-dsa-delayed-wgrad": (
        McoreCase(mla=True, layer_freq=(0, 1), delay_wgrad=True, microbatches=3, config=DSA_FIELDS + ROUTER),
        "dsa",
        "masked",
    ),
    "glm5.2-dsa-shared-topk": (
        McoreCase(mla=True, layer_freq=(1, 1, 1, 1), microbatches=3, config=DSA_FIELDS + TOPK_SHARING + ROUTER),
        "dsa",
        "unmasked",
    ),
    # GLM-5.2's top-k sharing under full recompute: a replayed layer reads its own microbatch's top-k (unmasked, as
    # Bridge's GPT step runs it; with a mask carrying the holder, Megatron-Core's own checkpoint loses it).
    "glm5.2-dsa-shared-topk-full-uniform1": (
        McoreCase(
            mla=True,
            layer_freq=(1, 1, 1, 1),
            microbatches=3,
            full_recompute=("uniform", 1),
            config=DSA_FIELDS + TOPK_SHARING + ROUTER,
        ),
        "dsa",
        "unmasked",
    ),
    "glm5-dsa-full-uniform1": (
        McoreCase(mla=True, layer_freq=(1, 1, 1), microbatches=3, full_recompute=("uniform", 1), config=DSA_FIELDS),
        "dsa",
        "unmasked",
    ),
    "kimi-k2": (
        McoreCase(mla=True, layer_freq=(0, 1, 1), expert_bias=True, shared_ffn=16, microbatches=3, config=KIMI_K2),
        None,
        "masked",
    ),
    "k-exaone": (
        McoreCase(
            layer_freq=(0, 1, 1, 1),
            rope=True,
            mtp=True,
            expert_bias=True,
            shared_ffn=16,
            load_balancing="global_aux_loss",
            aux_loss_coeff=0.01,
            z_loss_coeff=0.001,
            microbatches=3,
            config=K_EXAONE,
        ),
        None,
        "masked",
    ),
    "nemotron3-latent-moe": (HybridCase(pattern="M*EME/*E", microbatches=3, config=NEMOTRON3), None, "masked"),
    # Through train_plain_and_hook, which sets delay_wgrad_compute on the overlapped arm: the projections defer,
    # the MTP depth's too (its block runs whole in the head).
    "nemotron3-latent-moe-delayed-wgrad": (
        HybridCase(pattern="*E*E/*E", microbatches=3, config=NEMOTRON3, delay_wgrad=True),
        "mcore",
        "masked",
    ),
}


def _minimax_case() -> McoreCase:
    return McoreCase(
        layer_freq=(0, 1, 1),
        bf16=True,
        expert_bias=True,
        shared_ffn=16,
        dispatcher="flex",
        flex_backend="hybridep",
        microbatches=3,
        config=minimax_fields(),
    )


def _train(rank: int, world: int, name: str) -> dict:
    case, builder, step = (_minimax_case(), "minimax", "masked") if name == "minimax-m3" else CASES[name]
    install_latent_projections()
    install_kernels_for(case)
    if builder is None:
        return train_with_mcore_driver(rank, world, case)
    install_cpu_stubs()
    if case.dispatcher == "flex":
        from .fake_deepep import install_fake_deepep

        install_fake_deepep()
    init_megatron(world)
    build = {"dsa": build_dsa_gpt, "minimax": build_minimax_like, "mcore": build_model}[builder]
    return train_plain_and_hook(lambda: build(case), case, STEPS[step])


# The parameters that show a family's feature ran with a gradient (its loss or its projections live).
LIVE = {
    "glm5-dsa": "core_attention.indexer.linear_wq_b",
    "glm5-dsa-delayed-wgrad": "core_attention.indexer.linear_wq_b",
    "glm5.2-dsa-shared-topk": "core_attention.indexer.linear_wq_b",
    "glm5.2-dsa-shared-topk-full-uniform1": "core_attention.indexer.linear_wq_b",
    "glm5-dsa-full-uniform1": "core_attention.indexer.linear_weights_proj",
    "kimi-k2": "shared_experts.linear_fc1",
    "k-exaone": "mtp.layers.0",
    "minimax-m3": "router.weight",
    "nemotron3-latent-moe": "fc2_latent_proj",
    "nemotron3-latent-moe-delayed-wgrad": "fc2_latent_proj",
}


@pytest.mark.parametrize("name", [*sorted(CASES), "minimax-m3"])
def test_the_new_families_layers_under_megatron_cores_driver_are_bitwise_equal(name):
    case = _minimax_case() if name == "minimax-m3" else CASES[name][0]
    for outcome in run_local_ranks(_train, case.world, (name,)):
        plain, overlap = outcome.result["plain"], outcome.result["overlap"]
        assert_steps_bitwise(plain, overlap, case.steps, outcome.rank)
        phases = overlap["phases"]
        assert "paired" in (phases if isinstance(phases, set) else {p for step in phases for p, _ in step})
        live = [g for n, g in plain["grads"][-1].items() if LIVE[name] in n]
        assert live and all(g.abs().sum() > 0 for g in live), (name, LIVE[name])


def _model_facts(rank: int, world: int) -> dict:
    """What makes the cases above the features they claim: GLM-5.2's layers sharing a top-k have no indexer, the
    latent MoE's experts see the latent width, MiniMax-M3's routers stay fp32 in a bf16 model."""
    install_cpu_stubs()
    install_latent_projections()
    from .fake_deepep import install_fake_deepep

    install_fake_deepep()
    install_kernels_for(CASES["nemotron3-latent-moe"][0])
    init_megatron(world)

    sharing = build_dsa_gpt(CASES["glm5.2-dsa-shared-topk"][0])
    latent = build_model(CASES["nemotron3-latent-moe"][0])
    minimax = build_minimax_like(_minimax_case())
    return {
        "indexers": [layer.self_attention.core_attention.indexer is not None for layer in sharing.decoder.layers],
        "expert_input": [
            m.weight.shape[1] for n, m in latent.named_modules() if n.endswith("local_experts.0.linear_fc1")
        ],
        "router_dtypes": {str(m.weight.dtype) for n, m in minimax.named_modules() if n.endswith("mlp.router")},
        "rotary_dim": minimax.rotary_pos_emb.inv_freq.numel() * 2,
    }


def test_the_cases_have_the_features_they_claim():
    facts = run_local_ranks(_model_facts, 2)[0].result
    assert facts["indexers"] == [True, False, True, False]  # freq 2 from layer 1: layers 2 and 4 reuse a top-k
    assert facts["expert_input"] and set(facts["expert_input"]) == {16}  # moe_latent_size, not hidden 32
    assert facts["router_dtypes"] == {"torch.float32"}
    assert facts["rotary_dim"] == 8  # half of the 16 channels per head


# ---- config_refusals: what a config alone decides -----------------------------------------------------------------


def _provider(name: str, **fields):
    """A stand-in for a Megatron-Bridge provider class named ``name`` (recognized by its class names)."""
    return type(name, (SimpleNamespace,), {})(**fields)


def _vl_provider(name: str, **fields):
    def provide_language_model(self, pre_process=None, post_process=None, vp_stage=None):
        raise AssertionError("config_refusals builds nothing")

    return type(name, (SimpleNamespace,), {"provide_language_model": provide_language_model})(**fields)


@pytest.mark.parametrize(
    "config, names",
    [
        (_provider("MLAModelProvider", mtp_num_layers=1), []),
        (_vl_provider("KimiK25VLModelProvider"), ["model_class"]),
        (_vl_provider("MiniMaxM3VLModelProvider", position_embedding_type="rope"), ["model_class"]),
        (_provider("MiniMaxM3ModelProvider", position_embedding_type="rope"), []),  # its to_text_provider()
        (_vl_provider("Qwen3VLMoEModelProvider", position_embedding_type="mrope"), []),
        (_vl_provider("Qwen35VLMoEModelProvider", position_embedding_type="mrope", sequence_parallel=True), []),
        (
            _vl_provider(
                "Qwen35VLMoEModelProvider",
                position_embedding_type="mrope",
                context_parallel_size=2,
                vision_dp_when_cp=True,
            ),
            [],  # context parallelism runs, the vision tower split over the CP ranks too
        ),
        (_provider("GPTModelProvider", position_embedding_type="mrope"), ["mrope"]),
        (_provider("HybridModelProvider", mtp_num_layers=2, mtp_use_repeated_layer=True), []),  # the MTP block whole
        (
            _provider(
                "MLAModelProvider",
                mtp_num_layers=1,
                pipeline_model_parallel_size=2,
                pipeline_model_parallel_layout=[["embedding", "decoder", "mtp"], ["decoder", "loss"]],
            ),
            ["mtp_standalone_stage"],
        ),
        (
            _provider(
                "GPTModelProvider",
                recompute_granularity="selective",
                recompute_modules=["moe"],
                cuda_graph_impl="transformer_engine",
                cuda_graph_modules=["attn"],
            ),
            ["moe_recompute_graphs"],
        ),
        (  # a hybrid stack's MoE layers have no attention for the 'attn' graph
            _provider(
                "HybridModelProvider",
                hybrid_layer_pattern="*E",
                recompute_granularity="selective",
                recompute_modules=["moe"],
                cuda_graph_impl="transformer_engine",
                cuda_graph_modules=["attn"],
            ),
            [],
        ),
        (
            _provider(
                "GPTModelProvider",
                moe_token_dispatcher_type="flex",
                moe_flex_dispatcher_backend="ncclep",
                moe_ncclep_zero_copy=True,
            ),
            ["ncclep_zero_copy"],
        ),
    ],
    ids=lambda value: value if isinstance(value, list) else type(value).__name__,
)
def test_config_refusals_names_what_a_config_alone_decides(config, names):
    from megatron.bridge.training.ep_overlap.mcore.refusals import config_refusals

    found = config_refusals(config)
    assert [name for name, _ in found] == names
    assert all("fix: " in line and "\n" not in line for _, line in found)


def test_a_built_config_has_no_config_refusals_and_the_plan_raises_the_same_line():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.bridge.training.ep_overlap.mcore.refusals import config_refusals, refuse_unscheduled

    config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, mtp_num_layers=2)
    assert config_refusals(config) == []
    config.position_embedding_type = "mrope"
    ((name, line),) = config_refusals(config)
    model = SimpleNamespace(config=config, position_embedding_type="mrope")
    with pytest.raises(ValueError) as refused:
        refuse_unscheduled(model, mtp=True)
    assert name == "mrope" and str(refused.value) == line
