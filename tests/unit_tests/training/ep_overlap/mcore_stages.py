"""A rank's Megatron-Core model chunks for a pipeline layout, as plans, with the same weights in every layout.

Each chunk is a ``GPTModel`` (or ``HybridModel``) built with its own ``pre_process``/``post_process`` and
``vp_stage``, as Megatron-Core builds them; every weight matrix is set from a generator keyed by its global name
(global layer number, global expert index), so a PP = 1 model and a PP 2 x VPP 2 one hold the same model.
"""

import re

import torch

from .mcore_models import HybridCase, McoreCase, gpt_config, gpt_model


def global_name(plan, name: str, local_experts: int, ep_rank: int) -> str:
    """A parameter's name in the whole model: global layer number, global expert index; the last stage's copy of a
    tied output weight is the embedding's."""
    if name == "output_layer.weight" and plan.model.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"
    match = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if match:
        number = plan.model.decoder.layers[int(match.group(1))].layer_number - 1  # Megatron-Core counts from 1
        name = f"decoder.layers.{number}.{match.group(2)}"
    return re.sub(r"local_experts\.(\d+)\.", lambda m: f"experts.{ep_rank * local_experts + int(m.group(1))}.", name)


@torch.no_grad()
def set_weights(plans, local_experts: int, ep_rank: int) -> None:
    for plan in plans:
        for name, param in plan.model.named_parameters():
            if param.dim() < 2:  # norms: ones and zeros in every layout
                continue
            key = global_name(plan, name, local_experts, ep_rank)
            seed = sum(ord(c) * 131**i for i, c in enumerate(key)) % (2**61)
            param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)) * 0.05)


def build_plans(case: McoreCase, pp: int, vpp: int | None):
    """This rank's chunks (one per virtual stage; one without virtual stages, ``vpp`` None; the whole model at
    PP = 1), as plans with the shared weights."""
    from megatron.core import parallel_state

    from megatron.bridge.training.ep_overlap.mcore import chunk_for

    from .mcore_models import build_hybrid

    if isinstance(case, HybridCase):
        stages = range(vpp) if pp > 1 and vpp else [None]
        plans = [
            chunk_for(
                build_hybrid(
                    case,
                    pp=pp,
                    vpp=vpp if pp > 1 else None,
                    vp_stage=v,
                    pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=v is None, vp_stage=v),
                    post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=v is None, vp_stage=v),
                )
            )
            for v in stages
        ]
        set_weights(plans, local_experts=2, ep_rank=parallel_state.get_expert_model_parallel_rank())
        return plans
    return _gpt_plans(case, pp, vpp)


def gpt_stage_models(case: McoreCase, pp: int, vpp: int | None) -> list:
    """This rank's ``GPTModel`` chunks, one per virtual stage, as Megatron-Core builds them (no plan yet)."""
    from megatron.core import parallel_state

    pipeline = dict(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if pp > 1 else None,
        pipeline_dtype=torch.float32 if pp > 1 else None,
    )
    config = gpt_config(case, **pipeline)
    stages = range(vpp) if pp > 1 and vpp else [None]
    return [
        gpt_model(
            case,
            config,
            vp_stage=v,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=v is None, vp_stage=v),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=v is None, vp_stage=v),
        )
        for v in stages
    ]


def _gpt_plans(case: McoreCase, pp: int, vpp: int):
    from megatron.core import parallel_state

    from megatron.bridge.training.ep_overlap.mcore import chunk_for

    plans = [chunk_for(model) for model in gpt_stage_models(case, pp, vpp)]
    set_weights(plans, local_experts=2, ep_rank=parallel_state.get_expert_model_parallel_rank())
    return plans
