"""The harness's recipe: a small MoE GPT and its training settings, as nested dataclasses."""

from dataclasses import dataclass, field

from ep_overlap_lab.moe_gpt import MoEGPTConfig
from megatron.bridge.training.ep_overlap_config import EPOverlapCommOverlapConfig


@dataclass
class TrainConfig:
    """Steps and batch shape of one arm. ``warmup_steps`` are excluded from the steady-window statistics."""

    max_steps: int = 14  # enough matched steps for a 95% interval within about ±5% on `make run`
    warmup_steps: int = 1
    micro_batch_size: int = 1
    num_microbatches: int = 8
    seed: int = 1234
    lr: float = 1e-4
    collective_timeout_s: float = 120.0


@dataclass
class RecipeConfig:
    """Everything one run needs; Hydra-style overrides address it as ``model.x``, ``comm_overlap.x``, ``train.x``."""

    model: MoEGPTConfig
    comm_overlap: EPOverlapCommOverlapConfig
    train: TrainConfig = field(default_factory=TrainConfig)


def small_moe_recipe() -> RecipeConfig:
    """Two MoE layers, 4 experts (2 per rank on EP 2), top-1, 512 tokens per microbatch, fp32.

    Sized so one microbatch's compute and its all-to-all over a ~1 Gbit/s link are of the same order on a
    CPU core, which is where overlap matters.

    The router balances its load as MoE training does (sigmoid scores, aux-loss-free expert bias). Without it
    top-1 routing collapses within a dozen steps (one rank received 3x the other's rows by step 12), and the
    benchmark then measures ranks waiting for each other rather than communication. The bias moves 1e-2 per step:
    with Megatron-Core's default, 1e-3, one rank still received 1.4x the other's rows at step 12.
    """
    model = MoEGPTConfig(
        num_layers=2,
        hidden_size=512,
        num_attention_heads=8,
        ffn_hidden_size=1024,
        moe_ffn_hidden_size=1024,
        num_moe_experts=4,
        moe_router_topk=1,
        moe_router_pre_softmax=True,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=1e-2,
        expert_model_parallel_size=2,
        seq_length=512,
        vocab_size=1024,
        add_bias_linear=False,
        gated_linear_unit=False,
        bf16=False,
    )
    return RecipeConfig(model=model, comm_overlap=EPOverlapCommOverlapConfig(tp_comm_overlap=False))
