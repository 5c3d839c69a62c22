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
