"""The recipe check's CPU layer spec for a model with zero-centred norms (Step-3.5's ``layernorm_zero_centered_gamma``,
which Transformer Engine's norm reads and Megatron-Core's local norm refuses): every norm of the decoder layers, their
query/key norms, the final norm and the MTP layer's norms is zero-centred, with and without sequence parallelism."""

import pytest
import torch

from tests.functional_tests.recipe_check.cpu import local_mtp_block_spec, recipe_spec
from tests.unit_tests.training.ep_overlap.mcore_models import ZeroCenteredNorm


def _config(sequence_parallel: bool):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, num_moe_experts=2,
        moe_ffn_hidden_size=8, moe_layer_freq=[0, 1], normalization="RMSNorm", layernorm_zero_centered_gamma=True,
        qk_layernorm=True, mtp_num_layers=1, tensor_model_parallel_size=2 if sequence_parallel else 1,
        sequence_parallel=sequence_parallel, add_bias_linear=False, use_cpu_initialization=True,
    )  # fmt: skip


def _norms(spec):
    holders = [spec]
    for layer in spec.layer_specs:
        holders += [layer.submodules, getattr(getattr(layer.submodules, "self_attention", None), "submodules", None)]
    names = ("layer_norm", "input_layernorm", "pre_mlp_layernorm", "q_layernorm", "k_layernorm", "enorm", "hnorm")
    return [getattr(h, n) for h in holders if h is not None for n in names if getattr(h, n, None) is not None]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_zero_centred_models_norms_build_zero_centred_on_cpu(sequence_parallel, monkeypatch):
    from megatron.core import parallel_state

    # one pipeline stage, without process groups: the spec asks which layers the stage holds
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda *args, **kwargs: 0)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda *args, **kwargs: 1)
    config = _config(sequence_parallel)
    norms = _norms(recipe_spec(config)) + _norms(local_mtp_block_spec(config))
    built = [norm(config, 16, eps=1e-6) for norm in norms if not getattr(norm, "__name__", "").startswith("Identity")]
    assert len(built) >= 9  # 2 layers x (input, pre-MLP, query, key) and the final norm; the MTP layer's
    x = torch.randn(3, 16)
    for norm in built:
        assert isinstance(norm, ZeroCenteredNorm) and not norm.weight.any()
        assert torch.equal(norm(x), torch.nn.functional.rms_norm(x, (16,), torch.ones(16), 1e-6))
        assert all(getattr(p, "sequence_parallel", False) == sequence_parallel for p in norm.parameters())
