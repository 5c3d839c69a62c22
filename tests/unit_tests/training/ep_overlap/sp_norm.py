"""Test-only: a norm that takes sequence parallelism, as Transformer Engine's does (Megatron-Core's local norm refuses
it), so Megatron-Core's local layers run with ``sequence_parallel=True`` on CPU."""

import torch


class SequenceParallelNorm:
    """torch's LayerNorm or RMSNorm on the rank's part of the sequence; its weights carry ``sequence_parallel`` (their
    gradients are summed over the tensor-parallel group by ``finalize_model_grads``)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        norm = (torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm)(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def with_sequence_parallel_norms(spec):
    """``spec`` (a local decoder block spec) with each of its norms, the query/key (and MLA's) norms too, taking
    sequence parallelism; identities stay identities."""
    local_norm, spec.layer_norm = spec.layer_norm, SequenceParallelNorm
    for layer in spec.layer_specs:
        for holder in (layer.submodules, getattr(layer.submodules.self_attention, "submodules", None)):
            for name in ("input_layernorm", "pre_mlp_layernorm", "q_layernorm", "k_layernorm", "kv_layernorm"):
                if holder is not None and getattr(holder, name, None) is local_norm:
                    setattr(holder, name, SequenceParallelNorm)
    return spec


class NormColumnParallelLinear(torch.nn.Module):
    """A norm, then Megatron-Core's ``ColumnParallelLinear``: what Transformer Engine's fused
    ``LayerNormColumnParallelLinear`` computes, for Megatron-Core's local backend, which has none (MLA with
    ``qk_layernorm`` and no query LoRA rank asks for one as its query projection). The norm is
    :class:`SequenceParallelNorm` (it takes the rank's part of the sequence where the layout has sequence parallelism);
    the constructor takes Transformer Engine's arguments."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, gather_output: bool, bias: bool,
                 skip_bias_add: bool, is_expert: bool, stride: int = 1, skip_weight_param_allocation: bool = False,
                 tp_comm_buffer_name=None, tp_group=None, **unused):  # fmt: skip
        from megatron.core.tensor_parallel import ColumnParallelLinear

        super().__init__()
        self.norm = SequenceParallelNorm(config, input_size, eps=config.layernorm_epsilon)
        self.linear = ColumnParallelLinear(
            input_size, output_size, config=config, init_method=init_method, bias=bias, gather_output=gather_output,
            stride=stride, skip_bias_add=skip_bias_add, skip_weight_param_allocation=skip_weight_param_allocation,
            is_expert=is_expert, tp_comm_buffer_name=tp_comm_buffer_name, tp_group=tp_group,
        )  # fmt: skip

    def forward(self, x):
        return self.linear(self.norm(x))

    def backward_dw(self) -> None:
        """Delayed wgrad, as the linear delays it (the local one delays nothing)."""
        self.linear.backward_dw()


def use_norm_linear_for_local_mla() -> None:
    """Megatron-Core's local backend gives :class:`NormColumnParallelLinear` as its fused norm and linear, in this
    process."""
    from megatron.core.models import backends

    backends.LocalSpecProvider.column_parallel_layer_norm_linear = lambda self: NormColumnParallelLinear
