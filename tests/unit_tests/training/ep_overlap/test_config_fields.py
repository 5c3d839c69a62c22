"""The field audit: every ``TransformerConfig`` field Megatron-Core reads in a training step is read by this project's
plan too, or ``unread_fields.py`` says why it need not be, or the plan refuses it by name.

``config_reads.py`` records the fields each path reads in one step (``mcore_arms.py``): the plain path, Megatron-Core's
own plan (``GPTModel``), the hook and the engine. Each case also runs bitwise against the plain path through the hook.
The cases include Megatron-Bridge 0.6.2's newer families (``family_models.py`` builds what ``mcore_models`` does not:
DSA layers, MiniMax-M3's), each with the fields of its own features seen read by both paths (``FAMILY_FIELDS``).
Before the plan ran a dense layer's MLP through ``_forward_mlp``, this audit found ``mlp_chunks_for_training`` (and
``mlp_chunks_for_prefill``) read by the plain path and Megatron-Core's plan, never by ours.
"""

import dataclasses
from datetime import timedelta

import pytest

from . import lab, mcore_arms
from .bitwise import assert_bitwise
from .config_reads import ConfigReads
from .family_models import DSA_FIELDS, build_dsa_gpt, build_minimax_like, install_latent_projections, minimax_fields
from .local_ranks import run_local_ranks
from .mcore_arms import run_arm
from .mcore_cpu import init_megatron, install_cpu_stubs
from .mcore_models import HybridCase, McoreCase, build_model, install_kernels_for
from .test_new_families import K_EXAONE, NEMOTRON3
from .unread_fields import NOT_READ_BY_THE_ENGINE, NOT_READ_BY_THE_PLAN

MXFP8 = (("fp8", "e4m3"), ("fp8_recipe", "mxfp8"))
# name -> (case, fields set after the model is built)
CASES = {
    "default": (McoreCase(layer_freq=(1, 0, 1), microbatches=3), ()),
    "fp8": (McoreCase(layer_freq=(1, 0, 1), microbatches=3), MXFP8),
    "recompute-mlp": (McoreCase(layer_freq=(1, 0, 1), recompute=("mlp",), microbatches=3), ()),
    "recompute-mla-up-proj": (McoreCase(mla=True, recompute=("mla_up_proj",), microbatches=3), ()),
    "recompute-shared-experts": (McoreCase(shared_ffn=16, recompute=("shared_experts",), microbatches=3), ()),
    "recompute-core-attn": (McoreCase(recompute=("core_attn",), microbatches=3), ()),
    "router-padding-for-quantization": (
        McoreCase(microbatches=3),
        (("moe_router_padding_for_quantization", True), *MXFP8),
    ),
    "probs-on-input": (McoreCase(topk=1, microbatches=3, config=(("moe_apply_probs_on_input", True),)), ()),
    "mtp": (McoreCase(mtp=True, microbatches=3), ()),
    "hybrid": (HybridCase(pattern="*E-E", microbatches=3), ()),
    # Megatron-Bridge 0.6.2's newer families (test_new_families.py): GLM-5's DSA layers, Nemotron-3's latent MoE,
    # K-EXAONE's per-layer windows, NoPE layers, group-limited routing and global aux loss, MiniMax-M3's layers.
    "glm5-dsa": (McoreCase(mla=True, layer_freq=(0, 1, 1), microbatches=3, config=DSA_FIELDS), ()),
    "nemotron3-latent-moe": (HybridCase(pattern="M*EME", microbatches=3, config=NEMOTRON3), ()),
    "k-exaone": (
        McoreCase(
            layer_freq=(0, 1, 1, 1),
            rope=True,
            expert_bias=True,
            shared_ffn=16,
            load_balancing="global_aux_loss",
            aux_loss_coeff=0.01,
            z_loss_coeff=0.001,
            microbatches=3,
            config=K_EXAONE,
        ),
        (),
    ),
    "minimax-m3": (
        McoreCase(
            layer_freq=(0, 1, 1),
            expert_bias=True,
            shared_ffn=16,
            dispatcher="flex",
            flex_backend="hybridep",
            microbatches=3,
            config=minimax_fields(),
        ),
        (),
    ),
}
# Cases whose model mcore_models does not build (Transformer Engine-only modules, with their local twins).
BUILDERS = {"glm5-dsa": build_dsa_gpt, "minimax-m3": build_minimax_like}
# The engine refuses DSA at a step's start (step_hooks.step_problems: Megatron-Core's driver scales its indexer loss).
ENGINE_REFUSES = {"glm5-dsa"}
# Fields of a family's own features that a step reads, in the plain path and in the plan (the audit sees them).
FAMILY_FIELDS = {
    "glm5-dsa": {"dsa_indexer_loss_coeff", "dsa_indexer_use_sparse_loss", "dsa_indexer_rotate_activation"},
    "nemotron3-latent-moe": {"moe_latent_size"},
    "k-exaone": {"no_rope_freq", "moe_router_num_groups", "moe_router_group_topk", "moe_z_loss_coeff"},
    "minimax-m3": {"activation_func_clamp_value", "glu_linear_offset", "moe_router_dtype"},
}


def read_fields(rank: int, world: int, name: str) -> dict:
    case, fields = CASES[name]
    install_cpu_stubs()
    install_latent_projections()  # Transformer Engine's duplicated linear, for latent MoE (family_models.py)
    install_kernels_for(case)
    if case.dispatcher == "flex":
        from .fake_deepep import install_fake_deepep

        install_fake_deepep()
    if name in BUILDERS:  # this forked rank's arms build the case's model with its own builder
        mcore_arms.build_model = BUILDERS[name]
    init_megatron(world)
    arms = (
        lab.arms("plain", "hook", "engine")
        if isinstance(case, HybridCase)
        else lab.arms("plain", "mcore", "hook", "engine")
    )
    arms = tuple(arm for arm in arms if not (arm == "engine" and name in ENGINE_REFUSES))
    out = {}
    for arm in arms:
        reads = ConfigReads()

        def prepare(model, reads=reads):
            for field, value in fields:
                setattr(model.config, field, value)
            reads.attach(model)

        result = run_arm(arm, case, prepare=prepare, around_step=reads.recording)
        out[arm] = {"fields": reads.fields, "losses": result["losses"], "grads": result["grads"]}
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_field_megatron_core_reads_in_a_step_is_read_by_the_plan_or_explained(name):
    case = CASES[name][0]
    for outcome in run_local_ranks(read_fields, case.world, (name,)):
        got = outcome.result
        reference = got["plain"]["fields"] & got.get("mcore", got["plain"])["fields"]
        assert "num_moe_experts" in reference and "fp8" in reference  # the reader records something real
        assert FAMILY_FIELDS.get(name, set()) <= reference & got["hook"]["fields"]
        unread = reference - got["hook"]["fields"]
        assert unread <= NOT_READ_BY_THE_PLAN.keys(), (
            f"the plan reads none of {sorted(unread - NOT_READ_BY_THE_PLAN.keys())}"
        )
        if "engine" in got:
            unread = reference - got["engine"]["fields"]
            explained = NOT_READ_BY_THE_PLAN.keys() | NOT_READ_BY_THE_ENGINE.keys()
            assert unread <= explained, f"the engine reads none of {sorted(unread - explained)}"
        for step, (want, have) in enumerate(zip(got["plain"]["losses"], got["hook"]["losses"])):
            assert_bitwise(want, have, f"rank {outcome.rank} step {step} losses")
        for param, grad in got["plain"]["grads"].items():
            assert_bitwise(grad, got["hook"]["grads"][param], f"rank {outcome.rank} {param}")


def test_the_tables_name_real_fields_and_no_field_twice():
    from megatron.core.transformer.transformer_config import TransformerConfig

    names = {field.name for field in dataclasses.fields(TransformerConfig)}
    assert set(NOT_READ_BY_THE_PLAN) <= names and set(NOT_READ_BY_THE_ENGINE) <= names
    assert not NOT_READ_BY_THE_PLAN.keys() & NOT_READ_BY_THE_ENGINE.keys()


# A feature the plan does not schedule: refused by the hook (and so before the engine or Megatron-Core's driver runs a
# step) by its rule's name.
REFUSED = {
    "mlp_chunks": {"mlp_chunks_for_training": 2},
    "activation_offloading": {"cpu_offloading": True},
    "offloading_full_recompute": {
        "fine_grained_activation_offloading": True,
        "offload_modules": ["core_attn"],
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    },
    "early_attention_release": {"ep_overlap_early_attn_memory_release": True},
    # GLM-5.2's top-k sharing with an MTP layer under full recompute, and DeepSeek-V4's layer features
    # (moe_overlap_rules.model_features)
    "dsa_topk_sharing_mtp_recompute": {
        "experimental_attention_variant": "dsa",
        "dsa_indexer_topk_freq": 2,
        "mtp_num_layers": 1,
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    },
    "hyper_connections": {"enable_hyper_connections": True},
    "hash_routing": {"moe_n_hash_layers": 3},
    "attention_variant": {"experimental_attention_variant": "dsv4_hybrid"},
}


def _refused_all(rank: int, world: int, rules: list[str]) -> dict[str, str]:
    """Each rule's case, one model each, on the same ranks."""
    install_cpu_stubs()
    init_megatron(world)
    return {rule: _refused(REFUSED[rule]) for rule in rules}


def _refused(fields: dict) -> str:
    from megatron.bridge.training.ep_overlap.mcore import use_ep_overlap_schedule

    model = build_model(McoreCase())
    for field, value in fields.items():
        setattr(model.config, field, value)
    model.config.overlap_moe_expert_parallel_comm = True
    try:
        use_ep_overlap_schedule([model], timeout=timedelta(seconds=30))
    except ValueError as error:
        return str(error)
    return "accepted"


@pytest.fixture(scope="module")
def refusals() -> list[dict[str, str]]:
    return [outcome.result for outcome in run_local_ranks(_refused_all, 2, (sorted(REFUSED),))]


@pytest.mark.parametrize("rule", sorted(REFUSED))
def test_a_feature_the_plan_does_not_schedule_is_refused_by_name(refusals, rule):
    for refused in refusals:
        assert f"[{rule}]" in refused[rule] and "Fix: " in refused[rule], refused[rule]


# The memory features among the audited ones: selective recompute of parts the plan calls whole.
RECOMPUTED = {
    "mlp": McoreCase(layer_freq=(1, 0, 1), microbatches=3),
    "mla_up_proj": McoreCase(mla=True, microbatches=3),
    "shared_experts": McoreCase(shared_ffn=16, microbatches=3),
    "core_attn": McoreCase(microbatches=3),
}


def _activation_peaks(rank: int, world: int, module: str) -> dict:
    from dataclasses import replace

    from ep_overlap_lab.engine import EPOverlapEngine
    from megatron.bridge.training.ep_overlap.mcore import chunk_for, mcore_ep_groups

    from .mcore_arms import _data

    install_cpu_stubs()
    init_megatron(world)
    groups = mcore_ep_groups(timedelta(seconds=30))
    peaks = {}
    for recompute in ((), (module,)):
        case = replace(RECOMPUTED[module], recompute=recompute)
        for overlap in (False, True):
            engine = EPOverlapEngine(chunk_for(build_model(case)), groups, overlap=overlap, attention_wgrad_window=1)
            peaks[(bool(recompute), overlap)] = engine.step(_data(case, 0)).activation_peak_bytes
    return peaks


@pytest.mark.lab
@pytest.mark.parametrize("module", sorted(RECOMPUTED))
def test_selective_recompute_holds_less_in_the_overlapped_schedule_as_in_the_plain_path(module):
    for outcome in run_local_ranks(_activation_peaks, 2, (module,)):
        peaks = outcome.result
        for overlap in (False, True):
            assert peaks[(True, overlap)] < peaks[(False, overlap)], (module, overlap, peaks)
