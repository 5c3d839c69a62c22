"""Test-only: the layers of Megatron-Bridge 0.6.2's newer MoE families, built on CPU from local modules.

What each family's provider sets (``tests/.../test_new_families.py`` says which provider and which fields) is built
here at a small size, with the stand-ins Megatron-Core's Transformer Engine-only modules need on CPU:

* :class:`DuplicatedLinear`: Transformer Engine's ``TELinear`` with ``parallel_mode="duplicated"`` (every rank holds
  the whole weight; it returns ``(output, bias or None)``; with ``delay_wgrad_compute`` its backward leaves the weight
  gradient to ``backward_dw``, as Transformer Engine's does: each ``backward_dw`` call computes the oldest deferred
  one, then runs the hooks Megatron-Core's DDP registered for the weight, which it marks
  ``skip_backward_post_hook``; with ``gradient_accumulation_fusion`` each use's gradient goes into ``main_grad``
  itself, through :mod:`.fused_wgrad`'s torch twin of the kernel, delayed or not). Megatron-Core builds two modules
  from it only: an MoE layer's latent projections (``moe_latent_size``: ``fc1_latent_proj`` before the dispatch,
  ``fc2_latent_proj`` after the combine; it asserts Transformer Engine is installed) and the DSA indexer's
  projections.
  :func:`install_latent_projections` makes ``moe_layer`` take it, in this (forked) process only.
* :func:`dsa_block_spec`: the local twin of ``get_transformer_block_with_experimental_attention_variant_spec`` for a
  ``dsa`` config (GLM-5's ``transformer_layer_spec``; Transformer Engine only): per layer Megatron-Core's absorbed MLA
  with ``DSAttention`` (its indexer's linears :class:`DuplicatedLinear`, the down projections Megatron-Core's local
  column-parallel linear, which that attention also takes), an MoE or dense local MLP by ``moe_layer_freq``.
* :func:`build_minimax_like`: MiniMax-M3's text model as its provider sets it (``to_text_provider``): zero-centered
  RMSNorm (:class:`~.mcore_models.LocalNorm`, as Transformer Engine's norm reads the field), query/key norms, half
  the head dims rotated, quick-GELU GLU clamped at 7 with the linear half offset by 1, routers whose weights stay in
  fp32 in a bf16 model and widen their input to it (:class:`WidenedInputRouter`, the provider's router subclass and
  pre-wrap hook).

Both paths of a test build the same modules, so a difference is the schedule's.
"""

import copy

import torch

from .fused_wgrad import accumulate_wgrad

# DeepSeek sparse attention at this size: an indexer of 2 heads of 8 channels picking 4 of 8 keys. GLM-5's bridge
# turns the indexer's activation rotation off (Megatron-Core's takes bf16 only), trains the indexer with its sparse
# KL loss (coefficient 0.001) and sets the indexer's key norm epsilon; the rest are GLM-5's provider fields.
DSA_FIELDS = (
    ("experimental_attention_variant", "dsa"),
    ("dsa_indexer_n_heads", 2),
    ("dsa_indexer_head_dim", 8),
    ("dsa_indexer_topk", 4),
    ("dsa_indexer_rotate_activation", False),
    ("dsa_indexer_k_norm_epsilon", 1e-6),
    ("dsa_indexer_loss_coeff", 0.001),
    ("dsa_indexer_use_sparse_loss", True),
    ("normalization", "RMSNorm"),
    ("qk_layernorm", True),
    ("moe_router_load_balancing_type", "seq_aux_loss"),
    ("moe_aux_loss_coeff", 0.001),
    ("moe_router_dtype", "fp32"),
)


class DuplicatedLinear(torch.nn.Module):
    """Transformer Engine's ``TELinear`` with ``parallel_mode="duplicated"``, in torch (see the module docstring)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method,
        bias: bool,
        skip_bias_add: bool = False,
        parallel_mode: str | None = "duplicated",
        **unused,
    ):
        super().__init__()
        if parallel_mode != "duplicated":
            raise ValueError(f"the stand-in takes parallel_mode='duplicated' only, not {parallel_mode!r}")
        weight = torch.empty(output_size, input_size, dtype=config.params_dtype)
        init_method(weight)
        self.weight = torch.nn.Parameter(weight)
        self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype)) if bias else None
        self.skip_bias_add = skip_bias_add
        self.config, self.deferred, self.wgrad_hooks = config, [], []
        # Megatron-Core's DDP (with its config's delay_wgrad_compute) then hands the weight's gradient to main_grad
        # from backward_dw's hooks, not from the backward's
        self.weight.skip_backward_post_hook = True

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        bias = None if self.skip_bias_add else self.bias
        if self.config.delay_wgrad_compute and torch.is_grad_enabled():  # read per call: tests set it after the build
            out = _DeferredWgrad.apply(x, self.weight, bias, self)
        elif self._fused() and torch.is_grad_enabled():
            out = _FusedWgrad.apply(x, self.weight, bias)
        else:
            out = torch.nn.functional.linear(x, self.weight, bias)
        return (out, self.bias) if self.skip_bias_add else (out, None)

    def _fused(self) -> bool:
        """``gradient_accumulation_fusion`` (``fuse_wgrad_accumulation``), where a DDP gave the weight a main_grad."""
        return bool(getattr(self.config, "gradient_accumulation_fusion", False)) and hasattr(self.weight, "main_grad")

    def register_wgrad_accumulation_and_reduce_hooks(self, hook) -> None:
        """Megatron-Core's DDP registers its backward post-hook for the weight here (as on Transformer Engine's)."""
        self.wgrad_hooks.append(hook)

    def backward_dw(self) -> None:
        """One weight gradient the backward deferred (``delay_wgrad_compute``), the oldest, as Transformer Engine's
        ``backward_dw`` runs it (a module used twice in a microbatch needs two calls): added to ``weight.grad``
        (where no DDP hook takes it, the calls of a step sum there), then the DDP's hooks."""
        if not self.deferred:
            return
        grad_out, x = self.deferred.pop(0)
        x, grad_out = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
        if self._fused():  # into main_grad, and a zero gradient the DDP's hook drops (as Transformer Engine's dummy)
            accumulate_wgrad(x, grad_out, self.weight.main_grad)
            self.weight.grad_added_to_main_grad = True
            self.weight.grad = torch.zeros_like(self.weight)
        else:
            wgrad = grad_out.t().mm(x)
            self.weight.grad = wgrad if self.weight.grad is None else self.weight.grad + wgrad
        for hook in self.wgrad_hooks:
            hook()


class _DeferredWgrad(torch.autograd.Function):
    """A linear whose backward computes the input's (and bias's) gradient, leaving the weight's to ``backward_dw``."""

    @staticmethod
    def forward(ctx, x, weight, bias, module):
        ctx.save_for_backward(x, weight)
        ctx.module, ctx.has_bias = module, bias is not None
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        ctx.module.deferred.append((grad_out, x))
        grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_out.matmul(weight), None, grad_bias, None


class _FusedWgrad(torch.autograd.Function):
    """A linear whose backward adds the weight's gradient to ``weight.main_grad`` itself, one use at a time, and
    hands autograd a zero one marked ``grad_added_to_main_grad`` (as Megatron-Core's linears with the fusion)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        accumulate_wgrad(x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1]), weight.main_grad)
        weight.grad_added_to_main_grad = True
        grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_out.matmul(weight), torch.zeros_like(weight), grad_bias


def install_latent_projections() -> None:
    """Megatron-Core's MoE layer builds its latent projections from :class:`DuplicatedLinear` (it asserts Transformer
    Engine for them otherwise). Call in a forked rank before the model is built."""
    from megatron.core.transformer.moe import moe_layer

    moe_layer.HAVE_TE, moe_layer.TELinear = True, DuplicatedLinear


def _dsa_attention_spec(config):
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_dsa_module_spec_for_backend
    from megatron.core.tensor_parallel import ColumnParallelLinear

    class LocalWithDuplicated(LocalSpecProvider):
        def linear(self):
            return DuplicatedLinear

    spec = get_dsa_module_spec_for_backend(config, LocalWithDuplicated())
    spec.submodules.linear_q_down_proj = ColumnParallelLinear
    spec.submodules.linear_kv_down_proj = ColumnParallelLinear
    return spec


def dsa_block_spec(config, vp_stage: int | None = None):
    """The decoder block of a ``dsa`` config with local modules (see the module docstring)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    plain = copy.copy(config)  # Megatron-Core's local GPT spec refuses an attention variant; the MLPs are the same
    plain.experimental_attention_variant = None
    spec = get_gpt_decoder_block_spec(plain, use_transformer_engine=False, vp_stage=vp_stage)
    attention = _dsa_attention_spec(config)
    for layer_spec in spec.layer_specs:
        layer_spec.submodules.self_attention = attention
    return spec


def build_dsa_gpt(case, *, overlap_flag: bool = False):
    """``case``'s ``GPTModel`` (``McoreCase`` with ``mla=True`` and :data:`DSA_FIELDS` in its config) with DSA layers,
    RoPE as GLM-5 sets it, and one MTP layer like its last decoder layer where ``case.mtp``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    from .mcore_models import gpt_config

    config = gpt_config(case, overlap_flag=overlap_flag)
    spec = dsa_block_spec(config)
    mtp = get_gpt_mtp_block_spec(config, spec.layer_specs[-1], False) if case.mtp else None
    torch.manual_seed(1234)
    model = GPTModel(
        config,
        transformer_layer_spec=spec,
        mtp_block_spec=mtp,
        vocab_size=64,
        max_sequence_length=8,
        position_embedding_type="rope",
    )
    return model.bfloat16() if case.bf16 else model


# MiniMax-M3's text provider (MiniMaxM3Bridge.provider_bridge), as McoreCase.config pairs; the activation is added by
# minimax_fields() (Megatron-Core's fused quick-GELU, what the provider imports).
MINIMAX_M3_FIELDS = (
    ("normalization", "RMSNorm"),
    ("layernorm_zero_centered_gamma", True),
    ("qk_layernorm", True),
    ("gated_linear_unit", True),
    ("activation_func_clamp_value", 7.0),
    ("glu_linear_offset", 1.0),
    ("bias_activation_fusion", False),
    ("moe_router_pre_softmax", False),
    ("moe_router_dtype", "fp32"),
    ("moe_router_load_balancing_type", "aux_loss"),
    ("moe_aux_loss_coeff", 0.001),
)
MINIMAX_ROTARY_PERCENT = 0.5  # rotary_dim / head_dim of the published config


def minimax_fields() -> tuple:
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    return (*MINIMAX_M3_FIELDS, ("activation_func", quick_gelu))


def widened_input_router():
    """Megatron-Core's ``TopKRouter`` computing its logits in its weight's dtype (fp32), as MiniMax-M3's does."""
    from megatron.core.transformer.moe.router import TopKRouter

    class WidenedInputRouter(TopKRouter):
        def gating(self, input: torch.Tensor) -> torch.Tensor:
            return super().gating(input.to(dtype=self.weight.dtype))

    return WidenedInputRouter


def build_minimax_like(case):
    """``case``'s ``GPTModel`` with MiniMax-M3's layers (see the module docstring; ``case.config`` holds
    :func:`minimax_fields`)."""
    from functools import partial

    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.router import TopKRouter

    from .mcore_models import LocalNorm, _local_norms, gpt_block_spec, gpt_config

    config = gpt_config(case)
    spec = gpt_block_spec(config)
    router = widened_input_router()
    for layer_spec in spec.layer_specs:
        layer = layer_spec.submodules
        _local_norms(layer)  # Megatron-Core's local norm refuses zero-centered weights
        mlp = layer.mlp
        if isinstance(mlp, partial) and getattr(mlp.keywords.get("submodules"), "router", None) is TopKRouter:
            submodules = copy.copy(mlp.keywords["submodules"])
            submodules.router = router
            layer.mlp = partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": submodules})
    spec.layer_norm = LocalNorm
    torch.manual_seed(1234)
    model = GPTModel(
        config,
        transformer_layer_spec=spec,
        vocab_size=64,
        max_sequence_length=8,
        position_embedding_type="rope",
        rotary_percent=MINIMAX_ROTARY_PERCENT,
    )
    if case.bf16:
        model = model.bfloat16()
    for module in model.modules():  # the provider's pre-wrap hook: router weights back to fp32 after the cast
        if isinstance(module, router):
            module.weight.data = module.weight.data.float()
    return model
