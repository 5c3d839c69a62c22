"""Config of the reference MoE GPT: a Megatron-Core ``TransformerConfig`` plus what a GPT provider adds."""

import dataclasses
import math
from dataclasses import dataclass

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from ep_overlap_lab.moe_gpt.recompute import RECOMPUTABLE
from ep_overlap_lab.moe_gpt.router_losses import LOAD_BALANCING


@dataclass
class MoEGPTConfig(TransformerConfig):
    """Megatron field names drive every shape; the same object passes through ``CommOverlapConfig.setup``.

    Read by the reference model: ``num_layers``, ``hidden_size``, ``num_attention_heads``, ``ffn_hidden_size``
    (dense MLP), ``moe_ffn_hidden_size``, ``num_moe_experts``, ``moe_router_topk``, ``moe_layer_freq`` (int k:
    every k-th layer is MoE; list: 1 = MoE, 0 = dense per layer), ``expert_model_parallel_size``,
    ``gated_linear_unit`` (SwiGLU, else GELU), ``bf16``, ``init_method_std``, ``moe_router_score_function``
    (softmax or sigmoid), ``moe_router_pre_softmax`` (softmax only), ``moe_router_enable_expert_bias`` and
    ``moe_router_bias_update_rate`` (aux-loss-free load balancing, sigmoid only), ``layernorm_epsilon``,
    ``normalization`` (LayerNorm or RMSNorm), ``num_query_groups`` (grouped-query attention) and ``kv_channels``
    (the heads' width), ``moe_router_load_balancing_type`` (``aux_loss``, ``seq_aux_loss`` or ``none``) with
    ``moe_aux_loss_coeff``, ``moe_z_loss_coeff`` (the router losses, ``router_losses.py``), shared experts
    (``moe_shared_expert_intermediate_size``), selective ``recompute_granularity``/``recompute_modules``, full
    recompute (``recompute_granularity="full"`` with ``recompute_method`` and ``recompute_num_layers``, as
    ``ep_overlap/contract.py`` reads them), plus
    ``vocab_size`` and ``seq_length`` below (the set :data:`READ`).

    Refused by name, since the reference model does not compute them (``model_feature_problems``; a Megatron-Core
    model, the harness's ``--model_impl mcore``, does): ``global_aux_loss``, sinkhorn and lists of load-balancing
    types, a load-balancing coefficient with no load-balancing type (it would be ignored),
    ``moe_expert_capacity_factor``, a shared-expert gate, dropout, biases, tensor and context parallelism,
    multi-token prediction, hybrid patterns; and every other field set to a value other
    than its default, unless :data:`ELSEWHERE` or :data:`DERIVED` lists it.
    """

    vocab_size: int = 1024
    seq_length: int = 128
    # The reference model's token dispatcher is an all-to-all over the EP group.
    moe_token_dispatcher_type: str = "alltoall"
    # The reference model has no dropout; zero also keeps a Megatron-Core model built from this config deterministic.
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    # Which EP-overlap schedule runs this model; the rules differ (see training/moe_overlap_rules/).
    ep_overlap_schedule: str = "bridge"
    # For a Megatron-Core HybridModel built from this config (the harness's --model_impl mcore); the reference
    # model refuses it (model_feature_problems).
    hybrid_layer_pattern: str | None = None

    def activation_dtype(self) -> torch.dtype:
        """Dtype of parameters and activations: bf16, fp16, else fp32."""
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether layer ``layer_number`` (0-based) is an MoE layer, following ``moe_layer_freq``."""
        if not self.num_moe_experts:
            return False
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            return layer_number % freq == 0
        if len(freq) != self.num_layers:
            raise ValueError(f"moe_layer_freq has {len(freq)} entries but num_layers={self.num_layers}")
        return bool(freq[layer_number])


# Router settings the reference model can run: (field, is the value wrong, why, fix). Megatron-Core's own rule for
# expert bias (sigmoid scores only) is repeated so an override made after construction is refused too.
_ROUTER_RULES = (
    (
        "moe_router_score_function",
        lambda c: c.moe_router_score_function not in ("softmax", "sigmoid"),
        "the reference MoE GPT scores experts with softmax or sigmoid",
        "set it to 'softmax' or 'sigmoid'",
    ),
    (
        "moe_router_enable_expert_bias",
        lambda c: c.moe_router_enable_expert_bias and c.moe_router_score_function != "sigmoid",
        "expert bias needs sigmoid scores",
        "set moe_router_score_function='sigmoid', or moe_router_enable_expert_bias=False",
    ),
    (
        "moe_router_bias_update_rate",
        lambda c: (
            c.moe_router_enable_expert_bias
            and not (
                isinstance(c.moe_router_bias_update_rate, int | float)
                and math.isfinite(c.moe_router_bias_update_rate)
                and c.moe_router_bias_update_rate > 0
            )
        ),
        "the expert-bias update rate must be a positive number",
        "set it to a positive number, e.g. 1e-3",
    ),
)


# Model features the reference model does not have: (field, is it asked for, why, fix). Refused rather than ignored.
_FEATURE_RULES = (
    (
        "mtp_num_layers",
        lambda c: bool(c.mtp_num_layers),
        "the reference MoE GPT has no multi-token prediction layers",
        "drop it, or run a Megatron-Core model (the harness's --model_impl mcore)",
    ),
    (
        "hybrid_layer_pattern",
        lambda c: c.hybrid_layer_pattern is not None,
        "the reference MoE GPT is not a hybrid model",
        "drop it, or run a Megatron-Core HybridModel (the harness's --model_impl mcore)",
    ),
    (
        "recompute_granularity",
        lambda c: c.recompute_granularity not in (None, "selective", "full"),
        "the reference MoE GPT recomputes selected modules or whole layers",
        "set recompute_granularity='selective' (with recompute_modules), 'full' (with recompute_method and "
        "recompute_num_layers), or None",
    ),
    (
        "recompute_method",
        lambda c: c.recompute_method is not None and c.recompute_granularity != "full",
        "a recompute method chooses the layers of full recompute",
        "set recompute_granularity='full', or recompute_method=None",
    ),
    (
        "recompute_num_layers",
        lambda c: c.recompute_num_layers is not None and c.recompute_granularity != "full",
        "recompute_num_layers counts the layers of full recompute",
        "set recompute_granularity='full', or recompute_num_layers=None",
    ),
    (
        "recompute_modules",
        lambda c: c.recompute_granularity == "selective" and set(c.recompute_modules or ()) - set(RECOMPUTABLE),
        f"the reference MoE GPT recomputes {', '.join(RECOMPUTABLE)} only",
        "drop the others",
    ),
)


def _non_negative(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


# Router losses and shared experts the reference model computes (router_losses.py): (field, is the value one it
# cannot run or would ignore, why, fix).
_LOSS_RULES = (
    (
        "moe_router_load_balancing_type",
        lambda c: (
            not isinstance(c.moe_router_load_balancing_type, str)
            or c.moe_router_load_balancing_type not in (*LOAD_BALANCING, "none")
        ),
        f"the reference MoE GPT computes the {' and '.join(LOAD_BALANCING)} load-balancing losses only (one type)",
        f"use one of {', '.join(repr(k) for k in (*LOAD_BALANCING, 'none'))} (or moe_router_enable_expert_bias), "
        "or run --model_impl mcore",
    ),
    (
        "moe_aux_loss_coeff",
        lambda c: not _non_negative(c.moe_aux_loss_coeff),
        "the load-balancing coefficient must be one number, 0 or more",
        "set a number such as 1e-2 (0: no load-balancing loss)",
    ),
    (
        "moe_aux_loss_coeff",
        lambda c: (
            _non_negative(c.moe_aux_loss_coeff)
            and c.moe_aux_loss_coeff > 0
            and c.moe_router_load_balancing_type == "none"
        ),
        "moe_router_load_balancing_type='none' computes no load-balancing loss, so the coefficient would be ignored",
        "set moe_router_load_balancing_type='aux_loss' (or 'seq_aux_loss'), or moe_aux_loss_coeff=0",
    ),
    (
        "moe_z_loss_coeff",
        lambda c: c.moe_z_loss_coeff is not None and not _non_negative(c.moe_z_loss_coeff),
        "the z-loss coefficient must be a number, 0 or more",
        "set a number such as 1e-3, or None (no z-loss)",
    ),
    (
        "moe_shared_expert_intermediate_size",
        lambda c: (
            c.moe_shared_expert_intermediate_size is not None
            and not (
                isinstance(c.moe_shared_expert_intermediate_size, int) and c.moe_shared_expert_intermediate_size > 0
            )
        ),
        "the shared experts' width must be a positive integer",
        "set a positive integer, or None (no shared experts)",
    ),
)


# Every field of MoEGPTConfig is in exactly one place (tests check the union is the dataclass's fields):
#   READ       the reference model computes with it (the class docstring says how);
#   ELSEWHERE  the engine, the EP-overlap rules or the harness act on it, or _FEATURE_RULES / _ROUTER_RULES check it;
#   DERIVED    TransformerConfig fills it in from other fields (or it configures only kernels and logging of
#              Megatron-Core modules the reference model does not build);
# and every other field must keep its default: a value that differs is refused by name (_unimplemented), since the
# reference model would otherwise run without it and report numbers as if it had.
READ = frozenset(
    {
        "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "moe_ffn_hidden_size",
        "num_moe_experts", "moe_router_topk", "moe_layer_freq", "expert_model_parallel_size", "gated_linear_unit",
        "bf16", "fp16", "params_dtype", "init_method_std", "layernorm_epsilon", "moe_router_score_function",
        "moe_router_pre_softmax", "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
        "recompute_granularity", "recompute_modules", "recompute_method", "recompute_num_layers", "vocab_size",
        "seq_length", "num_query_groups", "kv_channels",
        "normalization", "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
        "moe_shared_expert_intermediate_size",
    }
)  # fmt: skip
ELSEWHERE = frozenset(
    {
        "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size", "pipeline_dtype",
        "overlap_moe_expert_parallel_comm", "delay_wgrad_compute", "overlap_dispatch_backward_with_experts_wgrad",
        "ep_overlap_early_attn_memory_release", "high_priority_a2a_comm_stream", "moe_token_dispatcher_type",
        "moe_flex_dispatcher_backend", "moe_grouped_gemm", "add_bias_linear", "mtp_num_layers", "hybrid_layer_pattern",
        "cuda_graph_impl", "ep_overlap_schedule", "batch_p2p_comm",
        "overlap_p2p_comm", "deallocate_pipeline_outputs", "variable_seq_lengths", "timers",
        "finalize_model_grads_func", "grad_scale_func", "no_sync_func", "grad_sync_func", "param_sync_func",
        "perform_initialization", "use_cpu_initialization", "deterministic_mode", "calculate_per_token_loss",
        "tp_comm_overlap", "moe_deepep_num_sms", "moe_hybridep_num_sms", "moe_enable_deepep",
        # CommOverlapConfig.setup writes these performance settings (TP/PP comm), which change no number
        "tp_comm_bootstrap_backend", "defer_embedding_wgrad_compute", "wgrad_deferral_limit",
        "moe_shared_expert_overlap", "cuda_graph_scope", "overlap_p2p_comm_warmup_flush", "batch_p2p_sync",
        # which layers each pipeline chunk holds (utils/pipeline_layout.py)
        "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage", "pipeline_model_parallel_layout",
        "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
    }
)  # fmt: skip
DERIVED = frozenset(
    {
        "expert_tensor_parallel_size", "autocast_dtype", "microbatch_group_size_per_vp_stage", "init_method",
        "output_layer_init_method", "embedding_init_method", "embedding_init_method_std", "cuda_graph_modules",
        "inference_cuda_graph_scope", "moe_grad_scale_func", "mtp_grad_scale_func",
        "experimental_attention_variant_loss_scale_func", "config_logger_dir", "_cpu_offloading_context",
        "bias_activation_fusion", "masked_softmax_fusion", "persist_layer_norm", "bias_dropout_fusion",
        "gradient_accumulation_fusion", "apply_rope_fusion", "cross_entropy_loss_fusion", "moe_permute_fusion",
        "moe_router_fusion", "attention_backend", "attention_softmax_in_fp32", "barrier_with_L1_time",
        "moe_per_layer_logging", "test_mode",
    }
)  # fmt: skip


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else None


def _differs(value, default) -> bool:
    try:
        return bool(value != default)
    except (TypeError, RuntimeError):  # tensors, callables without equality
        return value is not default


def _unimplemented(config: MoEGPTConfig) -> list[str]:
    """Fields outside :data:`READ`, :data:`ELSEWHERE` and :data:`DERIVED` that ``config`` sets to a value other than
    the default, and derived ones set to what the reference model does not compute."""
    problems = [
        f"{field.name}={getattr(config, field.name)!r}: the reference MoE GPT does not implement it and would "
        "ignore it; keep the default, or run a Megatron-Core model (the harness's --model_impl mcore)"
        for field in dataclasses.fields(config)
        if field.name not in READ | ELSEWHERE | DERIVED and _differs(getattr(config, field.name), _default(field))
    ]
    if config.normalization not in ("LayerNorm", "RMSNorm"):
        problems.append(
            f"normalization={config.normalization!r}: the reference MoE GPT normalizes with LayerNorm or RMSNorm; "
            "use one of them, or run --model_impl mcore"
        )
    problems += [
        f"{field}={getattr(config, field)!r}: {why}; {fix}" for field, wrong, why, fix in _LOSS_RULES if wrong(config)
    ]
    return problems


def model_feature_problems(config: MoEGPTConfig) -> list[str]:
    """One line per model feature ``config`` asks for that the reference model does not have (field, value, fix):
    the named rules, then every other field it would ignore."""
    named = [
        f"{field}={getattr(config, field)!r}: {why}; {fix}"
        for field, wanted, why, fix in _FEATURE_RULES
        if wanted(config)
    ]
    named += _recompute_problems(config)
    return named + _unimplemented(config)  # the rules' fields are in READ or ELSEWHERE: no field is named twice


def _recompute_problems(config: MoEGPTConfig) -> list[str]:
    """The full-recompute fields that name no segments (the rules' lines, as field=value: why; fix)."""
    from megatron.bridge.training.ep_overlap.settings import resolve

    return [
        f"{key.split('.', 1)[1]}={value!r}: {v.message.rstrip('.')}; fix: {v.fix}"
        for v in resolve(config).violations
        if v.name in ("full_recompute_method", "full_recompute_num_layers")
        for key, value in v.values.items()
    ]


def router_problems(config: MoEGPTConfig) -> list[str]:
    """One line per router setting of ``config`` the reference model cannot run (field, value, why, fix)."""
    return [
        f"{field}={getattr(config, field)!r}: {why}; {fix}"
        for field, wrong, why, fix in _ROUTER_RULES
        if wrong(config)
    ]


def refuse_unbuildable(config: MoEGPTConfig, ep_size: int) -> None:
    """Raises ValueError naming what the reference model cannot build for ``config`` on ``ep_size`` EP ranks."""
    if ep_size != config.expert_model_parallel_size:
        raise ValueError(
            f"expert_model_parallel_size={config.expert_model_parallel_size} but the EP group has {ep_size} ranks"
        )
    if config.add_bias_linear:
        raise ValueError("the reference MoE GPT has no biases; set add_bias_linear=False")
    problems = model_feature_problems(config)
    if problems:
        raise ValueError("; ".join(problems))
    if config.num_moe_experts and config.moe_token_dispatcher_type != "alltoall":
        raise ValueError(
            f"the reference MoE GPT implements the alltoall token dispatcher only, not "
            f"moe_token_dispatcher_type={config.moe_token_dispatcher_type!r}; use the Megatron-Core model for flex"
        )
