"""Each EP-overlap rule has a passing and a failing case; all violations are reported together."""

from types import SimpleNamespace

import pytest

from megatron.bridge.training.ep_overlap.options import EPOverlapOptions
from megatron.bridge.training.moe_overlap_rules import (
    MOE_OVERLAP_RULES,
    CommOverlapConfigError,
    check_moe_overlap,
    gather_facts,
)

VALID_MODEL = dict(
    expert_model_parallel_size=2,
    num_moe_experts=8,
    moe_token_dispatcher_type="alltoall",
    bf16=True,
    fp16=False,
    pipeline_model_parallel_size=1,
    virtual_pipeline_model_parallel_size=None,
    recompute_granularity=None,
    recompute_method=None,
    recompute_num_layers=None,
    recompute_modules=None,
    moe_shared_expert_overlap=False,
    moe_shared_expert_intermediate_size=None,
    mtp_num_layers=None,
    cuda_graph_impl="none",
    cuda_graph_modules=None,
    gradient_accumulation_fusion=False,
    add_bias_linear=False,
    add_qkv_bias=False,
)

ATTN_GRAPH = dict(cuda_graph_impl="transformer_engine", cuda_graph_modules=["attn"])
ON = dict(
    overlap=True, delay=False, grad_reduce=False, te=None, torch="2.8.0", options={}, micro_batch=None, built=True,
    fsdp=False,
)  # fmt: skip
PP2 = dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
CHUNKS = {"options": {"moe_ep_overlap_chunks": 2}}
BRIDGE = {"ep_overlap_schedule": "bridge"}
FULL = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
FLEX = {"moe_token_dispatcher_type": "flex"}
STATIC_HYBRIDEP = {**FLEX, "moe_flex_dispatcher_backend": "hybridep", "moe_expert_rank_capacity_factor": 1.5}

# rule name -> (failing case, passing case); each case is (model overrides, context overrides)
CASES = {
    "expert_parallel": (({"expert_model_parallel_size": 1}, {}), ({"expert_model_parallel_size": 4}, {})),
    "moe_experts": (({"num_moe_experts": None}, {}), ({"num_moe_experts": 2}, {})),
    "token_dispatcher": (
        ({"moe_token_dispatcher_type": "allgather"}, {}),
        ({"moe_token_dispatcher_type": "flex"}, {}),
    ),
    "precision": (({"bf16": False}, {}), ({"bf16": False, "fp16": True}, {})),
    "torch_version": (({}, {"torch": "2.5.1"}), ({}, {"torch": "2.6.0"})),
    # Megatron-Core's schedule pairs across virtual stages only; this project's also pairs the plain 1F1B pipeline.
    "pipeline_needs_vpp": (
        ({"pipeline_model_parallel_size": 2}, {}),
        ({**BRIDGE, "pipeline_model_parallel_size": 2}, {}),
    ),
    "no_full_recompute": (({"recompute_granularity": "full"}, {}), ({"recompute_granularity": "selective"}, {})),
    "no_recompute_method": (({"recompute_method": "uniform"}, {}), ({"recompute_method": None}, {})),
    "no_recompute_num_layers": (({"recompute_num_layers": 2}, {}), ({"recompute_num_layers": None}, {})),
    # This project's schedule replays full recompute: its fields must name the segments, and dropout stay off.
    "recompute_layers_need_full": (
        ({**BRIDGE, "recompute_method": "uniform", "recompute_num_layers": 1}, {}),
        ({**BRIDGE, **FULL}, {}),
    ),
    "full_recompute_method": (({**BRIDGE, **FULL, "recompute_method": None}, {}), ({**BRIDGE, **FULL}, {})),
    "full_recompute_num_layers": (
        ({**BRIDGE, **FULL, "recompute_num_layers": 0}, {}),
        ({**BRIDGE, **FULL, "recompute_method": "block", "recompute_num_layers": 2}, {}),
    ),
    "full_recompute_dropout": (({**BRIDGE, **FULL, "hidden_dropout": 0.1}, {}), ({**BRIDGE, **FULL}, {})),
    "full_recompute_mtp": (
        ({**BRIDGE, **FULL, "recompute_num_layers": 2, "mtp_num_layers": 1}, {}),
        ({**BRIDGE, **FULL, "mtp_num_layers": 1}, {}),
    ),
    # A recipe's full recompute reaches Megatron-Core's config assert before the hook installs this project's schedule.
    "full_recompute_in_the_recipe": (({**BRIDGE, **FULL}, {"built": False}), ({**BRIDGE, **FULL}, {})),
    "full_recompute_wgrad_window": (
        ({**BRIDGE, **FULL}, {"options": {"attention_wgrad_window": 2}}),
        ({**BRIDGE, **FULL, "recompute_method": "block"}, {"options": {"attention_wgrad_window": 2}}),
    ),
    "no_moe_recompute": (
        ({"recompute_modules": ["moe", "core_attn"]}, {}),
        ({"recompute_modules": ["core_attn"]}, {}),
    ),
    "no_shared_expert_overlap": (
        ({"moe_shared_expert_overlap": True}, {}),
        ({"moe_shared_expert_overlap": False}, {}),
    ),
    "mtp_layers": (({"mtp_num_layers": 2}, {}), ({"mtp_num_layers": 1}, {})),
    "cuda_graph_scope": (
        ({"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ["attn", "moe"]}, {}),
        ({"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ["attn", "moe_router"]}, {}),
    ),
    # No modules: whole layers, the MoE layer's all-to-all inside the graph.
    "cuda_graph_whole_layer": (
        ({"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": []}, {}),
        (ATTN_GRAPH, {}),
    ),
    # A graph of the whole step: Megatron-Core's own schedule is upstream's call; this project's runs it where the
    # dispatch reads nothing on the host (a static-shape flex backend).
    "cuda_graph_host_sync": (
        ({**BRIDGE, "cuda_graph_impl": "local"}, {}),
        ({**BRIDGE, "cuda_graph_impl": "local", **STATIC_HYBRIDEP}, {}),
    ),
    "cuda_graph_full_recompute": (({**BRIDGE, **FULL, **ATTN_GRAPH}, {}), ({**BRIDGE, **FULL}, {})),
    "cuda_graph_chunks": ((ATTN_GRAPH, CHUNKS), ({}, CHUNKS)),
    # Current scaling quantizes the replay as the first forward; delayed scaling's scales move in between.
    "fp8_delayed_full_recompute": (
        ({**BRIDGE, **FULL, "fp8": "hybrid", "fp8_recipe": "delayed"}, {}),
        ({**BRIDGE, **FULL, "fp8": "hybrid", "fp8_recipe": "mxfp8"}, {}),
    ),
    # What this project's plan does not schedule (the field audit): refused for it; Megatron-Core's schedule decides.
    "mlp_chunks": (({**BRIDGE, "mlp_chunks_for_training": 2}, {}), ({"mlp_chunks_for_training": 2}, {})),
    "activation_offloading": (({**BRIDGE, "cpu_offloading": True}, {}), ({"cpu_offloading": True}, {})),
    # The plan drives fine-grained offloading (test_activation_offloading.py), but not with full recompute.
    "offloading_full_recompute": (
        ({**BRIDGE, **FULL, "fine_grained_activation_offloading": True}, {}),
        ({**BRIDGE, "fine_grained_activation_offloading": True}, {}),
    ),
    "early_attention_release": (
        ({**BRIDGE, "ep_overlap_early_attn_memory_release": True}, {}),
        ({"ep_overlap_early_attn_memory_release": True}, {}),
    ),
    # Newer families' layer features (model_features.py): DeepSeek-V4's.
    "hyper_connections": (
        ({**BRIDGE, "enable_hyper_connections": True}, {}),
        ({"enable_hyper_connections": True}, {}),
    ),
    "hash_routing": (({**BRIDGE, "moe_n_hash_layers": 3}, {}), ({"moe_n_hash_layers": 3}, {})),
    "attention_variant": (
        ({**BRIDGE, "experimental_attention_variant": "dsv4_hybrid"}, {}),
        ({**BRIDGE, "experimental_attention_variant": "dsa"}, {}),
    ),
    "dsa_topk_sharing_mtp_recompute": (
        ({**BRIDGE, **FULL, "dsa_indexer_topk_freq": 2, "mtp_num_layers": 1}, {}),
        ({**BRIDGE, **FULL, "dsa_indexer_topk_freq": 2}, {}),
    ),
    "moe_tp_needs_sp": (
        ({"tensor_model_parallel_size": 2}, {}),
        ({"tensor_model_parallel_size": 2, "sequence_parallel": True}, {}),
    ),
    "no_dispatch_wgrad_overlap": (
        ({"overlap_dispatch_backward_with_experts_wgrad": True}, {}),
        ({"overlap_dispatch_backward_with_experts_wgrad": False}, {}),
    ),
    "delay_wgrad_needs_overlap": (({}, {"delay": True, "overlap": False}), ({}, {"delay": True})),
    "delay_wgrad_grad_reduce_te": (
        ({}, {"delay": True, "grad_reduce": True, "te": "2.6.0"}),
        ({}, {"delay": True, "grad_reduce": True, "te": "2.7.0"}),
    ),
    "delay_wgrad_grad_fusion_te": (
        ({"gradient_accumulation_fusion": True}, {"delay": True, "te": "2.6.0"}),
        ({"gradient_accumulation_fusion": True}, {"delay": True, "te": "2.7.0"}),
    ),
    # A repeated MTP layer's delayed wgrads round otherwise than the plain path's summed uses without fusion.
    "delay_wgrad_repeated_mtp_unfused": (
        ({**BRIDGE, "mtp_num_layers": 2, "mtp_use_repeated_layer": True}, {"delay": True}),
        (
            {**BRIDGE, "mtp_num_layers": 2, "mtp_use_repeated_layer": True, "gradient_accumulation_fusion": True},
            {"delay": True, "te": "2.7.0"},
        ),
    ),  # fmt: skip
    "delay_wgrad_graph_te": (
        ({**ATTN_GRAPH, "gradient_accumulation_fusion": True}, {"delay": True, "te": "2.10.0"}),
        ({**ATTN_GRAPH, "gradient_accumulation_fusion": True}, {"delay": True, "te": "2.12.0"}),
    ),
    "delay_wgrad_graph_grad_fusion": (
        (ATTN_GRAPH, {"delay": True, "te": "2.12.0"}),
        ({**ATTN_GRAPH, "gradient_accumulation_fusion": True}, {"delay": True, "te": "2.12.0"}),
    ),
    "delay_wgrad_graph_attn_bias": (
        ({**ATTN_GRAPH, "gradient_accumulation_fusion": True, "add_qkv_bias": True}, {"delay": True, "te": "2.12.0"}),
        ({**ATTN_GRAPH, "gradient_accumulation_fusion": True}, {"delay": True, "te": "2.12.0"}),
    ),
    # This project's schedule options (EPOverlapOptions)
    "attention_wgrad_window": (
        ({}, {"options": {"attention_wgrad_window": 3}}),
        ({}, {"options": {"attention_wgrad_window": 2}}),
    ),
    "attention_wgrad_auto_pp1": (
        (PP2, {"options": {"attention_wgrad_window": None}}),
        ({}, {"options": {"attention_wgrad_window": None}}),
    ),
    "launch_off_host_needs_overlap": (
        ({}, {"overlap": False, "options": {"launch_off_host": True}}),
        ({}, {"options": {"launch_off_host": True}}),
    ),
    "chunks_choice": (({}, {"options": {"moe_ep_overlap_chunks": 3}}), ({}, CHUNKS)),
    "chunks_need_overlap": (({}, {**CHUNKS, "overlap": False}), ({}, CHUNKS)),
    "chunks_pp1": ((PP2, CHUNKS), ({}, CHUNKS)),
    "chunks_or_edge_pairing": (
        ({}, {"options": {"moe_ep_overlap_chunks": 2, "edge_pairing": True}}),
        ({}, {"options": {"edge_pairing": True}}),
    ),
    "chunks_aux_loss": (({"moe_aux_loss_coeff": 0.01}, CHUNKS), ({"moe_aux_loss_coeff": 0.0}, CHUNKS)),
    "chunks_z_loss": (({"moe_z_loss_coeff": 0.001}, CHUNKS), ({"moe_z_loss_coeff": None}, CHUNKS)),
    "chunks_capacity": (({"moe_expert_capacity_factor": 1.0}, CHUNKS), ({}, CHUNKS)),
    "chunks_micro_batch": (({}, {**CHUNKS, "micro_batch": 1}), ({}, {**CHUNKS, "micro_batch": 2})),
    # Megatron-FSDP runs at PP 1 (Megatron-Core's driver sets the plan's per-layer reshard hooks); no pipeline driver
    # makes its calls.
    "megatron_fsdp": (({**BRIDGE, "pipeline_model_parallel_size": 2}, {"fsdp": True}), (BRIDGE, {"fsdp": True})),
}


def _checked(fake_versions, check, model_overrides, context_overrides):
    context = {**ON, **context_overrides}
    fake_versions(torch=context["torch"], te=context["te"])
    model = SimpleNamespace(**{**VALID_MODEL, **model_overrides})
    return check(
        model,
        overlap_moe_expert_parallel_comm=context["overlap"],
        delay_wgrad_compute=context["delay"],
        overlap_grad_reduce=context["grad_reduce"],
        options=EPOverlapOptions(**context["options"]),
        micro_batch_size=context["micro_batch"],
        model_config_built=context["built"],
        megatron_fsdp=context["fsdp"],
    )


def violated(fake_versions, model_overrides, context_overrides):
    found = _checked(fake_versions, check_moe_overlap, model_overrides, context_overrides)
    return {violation.name: violation for violation in found}


def test_every_rule_has_cases():
    assert {rule.name for rule in MOE_OVERLAP_RULES} == set(CASES)
    assert set(UPSTREAM_PHRASES) <= set(CASES)


@pytest.mark.parametrize("rule_name", sorted(CASES))
def test_rule_fails_and_passes(fake_versions, rule_name):
    failing, passing = CASES[rule_name]
    found = violated(fake_versions, *failing)
    assert rule_name in found, f"{rule_name} should fail for {failing}; got {sorted(found)}"
    rule = next(r for r in MOE_OVERLAP_RULES if r.name == rule_name)
    text = str(found[rule_name])
    for field in rule.fields:
        assert field in text
    facts = _checked(fake_versions, gather_facts, *failing)
    assert "Fix: " + (rule.fix(facts) if callable(rule.fix) else rule.fix) in text
    assert violated(fake_versions, *passing) == {}


def test_full_recompute_is_this_projects_and_mcore_still_refuses_it(fake_versions):
    """The same full-recompute config: accepted where this project's schedule runs the layers; refused, naming the
    Megatron-Core release that still refuses it, where Megatron-Core's own schedule does."""
    assert violated(fake_versions, {**BRIDGE, **FULL}, {}) == {}
    found = violated(fake_versions, FULL, {})
    assert set(found) == {"no_full_recompute", "no_recompute_method", "no_recompute_num_layers"}
    line = str(found["no_full_recompute"])
    assert "0.19" in line and "disable full recomputation" in line


def test_valid_config_has_no_violations(fake_versions):
    assert violated(fake_versions, {}, {"delay": True}) == {}


def test_nothing_is_checked_with_overlap_off(fake_versions):
    assert violated(fake_versions, {"expert_model_parallel_size": 1, "bf16": False}, {"overlap": False}) == {}


def test_reference_engine_accepts_fp32(fake_versions):
    found = violated(fake_versions, {"bf16": False, "ep_overlap_schedule": "bridge"}, {})
    assert found == {}


def test_a_registered_hook_says_which_schedule_runs_the_layers(fake_versions):
    """A recipe's ``cfg.model.register_pre_wrap_hook(partial(use_ep_overlap_schedule, ...))`` runs before the hook
    does, and already counts as this project's schedule; another hook does not."""
    from functools import partial

    from megatron.bridge.training.ep_overlap.mcore import use_ep_overlap_schedule

    ours = [lambda models: models, partial(use_ep_overlap_schedule, attention_wgrad_window=1)]
    assert violated(fake_versions, {"bf16": False, "_pre_wrap_hooks": ours}, {}) == {}
    assert violated(fake_versions, {"bf16": False, "_pre_wrap_hooks": [use_ep_overlap_schedule]}, {}) == {}
    found = violated(fake_versions, {"bf16": False, "_pre_wrap_hooks": [lambda models: models]}, {})
    assert list(found) == ["precision"]


def test_te_version_rules_skip_pure_torch_grouped_gemm(fake_versions):
    # Without Transformer Engine the experts use torch grouped GEMMs, which have no TE version needs.
    found = violated(fake_versions, {"gradient_accumulation_fusion": True}, {"delay": True, "grad_reduce": True})
    assert found == {}


def test_te_rule_message_names_pure_torch_path(fake_versions):
    found = violated(fake_versions, {}, {"delay": True, "grad_reduce": True, "te": "2.6.0"})
    assert "pure-torch grouped GEMM path has no Transformer Engine requirement" in str(
        found["delay_wgrad_grad_reduce_te"]
    )


def test_legacy_cuda_graph_scope_field_is_read(fake_versions):
    found = violated(fake_versions, {"cuda_graph_impl": "transformer_engine", "cuda_graph_scope": "mlp"}, {})
    assert "cuda_graph_scope" in found


# Megatron-Core 0.19 takes the graph modules as cuda_graph_modules or, deprecated, cuda_graph_scope; its
# __post_init__ (which a Megatron-Bridge provider defers to finalize(), after a recipe's setup) moves the latter into
# the former where that is left at its default, "full".
GRAPH_MODULE_SPELLINGS = {
    "cuda_graph_modules": lambda modules: {"cuda_graph_modules": modules},
    "cuda_graph_scope": lambda modules: {"cuda_graph_modules": "full", "cuda_graph_scope": modules},
}


def _reading(*fields: str) -> list[str]:
    """The rules whose lines show one of ``fields`` (fact keys)."""
    return sorted(rule.name for rule in MOE_OVERLAP_RULES if set(fields) & set(rule.fields))


GRAPH_MODULE_RULES = _reading("model.cuda_graph_modules", "model.cuda_graph_scope")


def _spelled_case(rule_name, spelled):
    """The rule's failing case with its graph modules (['attn'] where it sets none) given through ``spelled``."""
    model, context = CASES[rule_name][0]
    model = dict(model)
    modules = model.pop("cuda_graph_modules", ["attn"])
    return {**model, **spelled(modules)}, context


def _named_fields(violation) -> set[str]:
    """The model fields a violation names: in its values, its message and its fix."""
    text = " ".join([*violation.values, violation.message, violation.fix])
    return {name for name in ("cuda_graph_modules", "cuda_graph_scope") if name in text}


@pytest.mark.parametrize("rule_name", GRAPH_MODULE_RULES)
def test_a_graph_modules_rule_names_cuda_graph_modules_where_the_user_set_it(fake_versions, rule_name):
    case = _spelled_case(rule_name, GRAPH_MODULE_SPELLINGS["cuda_graph_modules"])
    violation = violated(fake_versions, *case)[rule_name]
    assert _named_fields(violation) == {"cuda_graph_modules"}, str(violation)
    assert "model.cuda_graph_modules=" in str(violation)


@pytest.mark.parametrize("rule_name", GRAPH_MODULE_RULES)
def test_a_graph_modules_rule_names_the_deprecated_cuda_graph_scope_where_the_user_set_that(fake_versions, rule_name):
    """Issue 54: the fix told a user to drop 'moe' from cuda_graph_scope whatever field they had set."""
    case = _spelled_case(rule_name, GRAPH_MODULE_SPELLINGS["cuda_graph_scope"])
    violation = violated(fake_versions, *case)[rule_name]
    assert _named_fields(violation) == {"cuda_graph_scope"}, str(violation)
    modules = case[0]["cuda_graph_scope"]
    assert f"model.cuda_graph_scope={tuple(modules)!r}" in str(violation)  # what the user set, not 'full' beside it


# cuda_graph_impl's deprecated spellings in Megatron-Core 0.19: each sets it where it is 'none', and stays True.
GRAPH_IMPL_SPELLINGS = {
    "transformer_engine": {
        "external_cuda_graph": {"cuda_graph_impl": "none", "external_cuda_graph": True},
        "external_cuda_graph after __post_init__": {
            "cuda_graph_impl": "transformer_engine",
            "external_cuda_graph": True,
        },
    },
    "local": {
        "enable_cuda_graph": {"cuda_graph_impl": "none", "enable_cuda_graph": True},
        "enable_cuda_graph after __post_init__": {"cuda_graph_impl": "local", "enable_cuda_graph": True},
    },
}
GRAPH_IMPL_CASES = [
    (name, spelling)
    for name in _reading("model.cuda_graph_impl")
    for spelling in GRAPH_IMPL_SPELLINGS[CASES[name][0][0]["cuda_graph_impl"]]
]


@pytest.mark.parametrize("rule_name, spelling", GRAPH_IMPL_CASES)
def test_a_cuda_graph_impl_rule_names_the_deprecated_flag_that_turned_graphs_on(fake_versions, rule_name, spelling):
    model, context = CASES[rule_name][0]
    impl = model["cuda_graph_impl"]
    found = violated(fake_versions, {**model, **GRAPH_IMPL_SPELLINGS[impl][spelling]}, context)
    assert rule_name in found, f"{spelling} should break {rule_name} as cuda_graph_impl={impl!r} does"
    violation, field = found[rule_name], spelling.split()[0]
    assert f"model.{field}=True" in str(violation) and "model.cuda_graph_impl=" not in str(violation)
    # Graphs go off where they were turned on: with the flag still set, cuda_graph_impl='none' changes nothing.
    assert "cuda_graph_impl='none'" not in violation.fix
    as_impl = violated(fake_versions, model, context)[rule_name]
    assert f"model.cuda_graph_impl={impl!r}" in str(as_impl) and field not in str(as_impl)
    if "cuda_graph_impl='none'" in as_impl.fix:
        off = f"{field}=False"
        # A fix keeping graphs (per layer) turns the flag off first: Megatron-Core refuses it beside cuda_graph_impl.
        keeps_graphs = f"set {off}, and cuda_graph_impl='transformer_engine' with cuda_graph_modules="
        assert violation.fix == as_impl.fix.replace("cuda_graph_impl='none'", off) or (
            violation.fix.startswith(keeps_graphs)
        )


def test_moe_recompute_is_named_as_the_user_asked_for_it(fake_versions):
    """Megatron-Core 0.19's deprecated moe_layer_recompute puts 'moe' in recompute_modules in its __post_init__."""
    by_flag = violated(fake_versions, {"recompute_modules": ["core_attn"], "moe_layer_recompute": True}, {})
    by_list = violated(fake_versions, {"recompute_modules": ["moe", "core_attn"]}, {})
    by_flag, by_list = by_flag["no_moe_recompute"], by_list["no_moe_recompute"]
    assert "model.moe_layer_recompute=True" in str(by_flag)
    assert by_flag.fix.startswith("set moe_layer_recompute=False,")
    assert "model.recompute_modules=['moe', 'core_attn']" in str(by_list) and by_list.fix.startswith("remove 'moe'")
    for violation in (by_flag, by_list):
        assert "disable moe in recompute_modules" in violation.message  # upstream's phrase either way


def test_error_lists_every_violation_one_per_line(fake_versions):
    found = violated(
        fake_versions,
        {"expert_model_parallel_size": 1, "moe_token_dispatcher_type": "allgather", "recompute_granularity": "full"},
        {},
    )
    error = CommOverlapConfigError(found.values())
    lines = str(error).splitlines()
    assert lines[0] == "communication overlap config has 3 problems:"
    assert len(lines) == 4
    assert "model.expert_model_parallel_size=1" in lines[1]
    assert "model.moe_token_dispatcher_type='allgather'" in lines[2]
    assert "model.recompute_granularity='full'" in lines[3]
    assert all("Fix: " in line for line in lines[1:])
    assert isinstance(error, ValueError)


# The phrase of Megatron-Bridge's assert for the same rule: code that matches upstream's messages keeps working.
UPSTREAM_PHRASES = {
    "expert_parallel": "only supported when expert_model_parallel_size > 1",
    "moe_experts": "only supported when num_moe_experts > 1",
    "token_dispatcher": "only supported when moe_token_dispatcher_type == 'alltoall' or 'flex'",
    "precision": "only supported when using bf16 or fp16 models",
    "torch_version": "hang issue with torch version < 2.6.0",
    "pipeline_needs_vpp": "virtual_pipeline_model_parallel_size must be specified when "
    "pipeline_model_parallel_size > 1",
    "no_full_recompute": "disable full recomputation",
    "no_recompute_method": "disable recomputation method",
    "no_recompute_num_layers": "recompute_num_layers must be None",
    "no_moe_recompute": "disable moe in recompute_modules",
    "no_shared_expert_overlap": "disable moe_shared_expert_overlap",
    "mtp_layers": "MTP supports at most one layer",
    "delay_wgrad_needs_overlap": "overlap_moe_expert_parallel_comm is required for delay_wgrad_compute",
    "delay_wgrad_grad_reduce_te": "TE version >= 2.7.0 is required for overlap_grad_reduce when using "
    "delay_wgrad_compute",
    "delay_wgrad_grad_fusion_te": "TE version >= 2.7.0 is required for gradient_accumulation_fusion when using "
    "delay_wgrad_compute",
    "delay_wgrad_graph_te": "CUDA graph with delay_wgrad_compute requires TE version >= 2.12.0",
    "delay_wgrad_graph_grad_fusion": "CUDA graph with delay_wgrad_compute requires gradient_accumulation_fusion",
    "delay_wgrad_graph_attn_bias": "CUDA graph with delay_wgrad_compute does not support attention bias",
}


@pytest.mark.parametrize("name, phrase", sorted(UPSTREAM_PHRASES.items()))
def test_violation_line_carries_upstreams_phrase(fake_versions, name, phrase):
    (failing, _passing) = CASES[name]
    found = violated(fake_versions, *failing)
    assert phrase in str(found[name])


def test_error_is_caught_as_an_assertion_error(fake_versions):
    with pytest.raises(AssertionError, match="MTP supports at most one layer"):
        raise CommOverlapConfigError(violated(fake_versions, {"mtp_num_layers": 2}, {}).values())


def test_graph_modules_count_without_cuda_graph_impl(fake_versions):
    # Upstream judges the graphed modules alone; a recipe may set cuda_graph_impl later.
    found = violated(fake_versions, {"cuda_graph_modules": ["attn"], "add_bias_linear": True}, {"delay": True})
    assert "delay_wgrad_graph_attn_bias" in found


# Names a fix may mention that are not config fields: functions of this project and Megatron-Bridge that do what the
# fix asks.
CALLABLES = {"apply_flex_dispatcher_backend", "use_bridge_schedule", "use_ep_overlap_schedule"}
CALLABLES |= {"register_pre_wrap_hook", "full_recompute"}  # use_ep_overlap_schedule's keyword
CALLABLES |= {"get_forward_backward_func"}  # the schedule a training loop takes from ep_overlap.mcore
# Fields Megatron-Bridge 0.6.2's DeepSeek-V4 bridge sets on its provider, which Megatron-Core 0.19 does not declare.
CALLABLES |= {"enable_hyper_connections", "moe_n_hash_layers"}


def _existing_names() -> set[str]:
    """Fields of the configs a fix can name: the model (Megatron-Core's TransformerConfig), comm_overlap, ddp
    (Megatron-Core's DistributedDataParallelConfig), the schedule's options, and the training config's
    micro_batch_size (Megatron-Bridge's and the harness's)."""
    import dataclasses

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.bridge.training.comm_overlap import CommOverlapConfig

    configs = (TransformerConfig, CommOverlapConfig, DistributedDataParallelConfig, EPOverlapOptions)
    return {f.name for config in configs for f in dataclasses.fields(config)} | {"micro_batch_size", "comm_overlap"}


def _named(fix: str) -> set[str]:
    """The snake_case names a fix mentions, outside quoted values."""
    import re

    return set(re.findall(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b", re.sub(r"'[^']*'", "", fix)))


@pytest.mark.parametrize("rule_name", sorted(CASES))
def test_every_fix_names_fields_that_exist_on_the_config_it_names(fake_versions, rule_name):
    violation = violated(fake_versions, *CASES[rule_name][0])[rule_name]
    missing = _named(violation.fix) - _existing_names() - CALLABLES
    assert not missing, f"[{rule_name}] fix names {sorted(missing)}, which no config has: {violation.fix}"


@pytest.mark.parametrize(
    "dispatch, runs, named",
    [
        ({"moe_token_dispatcher_type": "alltoall"}, False, "the alltoall dispatcher copies its split sizes"),
        ({**FLEX, "moe_flex_dispatcher_backend": "deepep"}, False, "the deepep backend waits on the host"),
        ({**FLEX, "moe_flex_dispatcher_backend": "hybridep"}, False, "HybridEP without moe_expert_rank_capacity"),
        ({**STATIC_HYBRIDEP, "moe_hybridep_pad_uneven_dispatch_inputs": True}, False, "the largest token count"),
        ({**FLEX, "moe_flex_dispatcher_backend": "ncclep"}, False, "NCCL EP without moe_ncclep_static_shape"),
        (STATIC_HYBRIDEP, True, None),
        ({**FLEX, "moe_flex_dispatcher_backend": "ncclep", "moe_ncclep_static_shape": True}, True, None),
    ],
    ids=["alltoall", "deepep", "hybridep", "hybridep-uneven", "ncclep", "hybridep-static", "ncclep-static"],
)
@pytest.mark.parametrize(
    "graphs",
    [
        {"cuda_graph_impl": "full_iteration"},
        {"cuda_graph_impl": "local"},
        {"cuda_graph_impl": "local", "cuda_graph_modules": ["full_iteration"]},
        {"cuda_graph_impl": "none", "cuda_graph_modules": ["full_iteration"]},  # Megatron-Core promotes it
    ],
    ids=["full_iteration", "local", "local-full_iteration", "none-full_iteration"],
)
def test_a_whole_step_graph_runs_our_schedule_only_with_a_static_shape_dispatch(graphs, dispatch, runs, named):
    config = SimpleNamespace(**{**VALID_MODEL, **BRIDGE, **graphs, **dispatch})
    found = [v for v in check_moe_overlap(config, overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=False)
             if v.name == "cuda_graph_host_sync"]  # fmt: skip
    assert (not found) == runs, found
    if not runs:
        assert named in found[0].message and "with a static-shape flex backend (" in found[0].fix
        assert "moe_expert_rank_capacity_factor set, or 'ncclep' with moe_ncclep_static_shape=True" in found[0].fix


@pytest.mark.parametrize("schedule, refused", [("mcore", True), ("bridge", False)])
def test_moe_recompute_is_refused_only_under_megatron_cores_own_schedule(schedule, refused):
    # Megatron-Core's config asserts it with the flag on (its MoE layer checkpoints the module's whole forward, which
    # its plan runs step by step); this project's schedule replays each MoE part in the backward.
    fields = {"recompute_granularity": "selective", "recompute_modules": ["moe"]}
    config = SimpleNamespace(**{**VALID_MODEL, **(BRIDGE if schedule == "bridge" else {}), **fields})
    violations = check_moe_overlap(config, overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=False)
    found = {v.name for v in violations}
    assert ("no_moe_recompute" in found) == refused, found


@pytest.mark.lab  # the docs are this project's: the patch does not carry them
def test_the_error_communication_overlap_md_shows_is_the_one_raised(fake_versions):
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[4] / "docs/training/communication-overlap.md").read_text()
    shown = re.search(r"## One error, every problem\n.*?```\n(.*?)```", doc, re.S).group(1)
    found = violated(
        fake_versions, {"expert_model_parallel_size": 1, "moe_token_dispatcher_type": "allgather", "bf16": False}, {}
    )
    assert str(CommOverlapConfigError(found.values())) + "\n" == shown
