"""Fine-grained activation offloading (``fine_grained_activation_offloading``) under the plan, as Megatron-Core's plan
drives it.

Megatron-Core's offload manager keeps one chunk handler per microbatch and model chunk, made where that microbatch's
forward starts: ``GPTModel.forward`` (``HybridModel.forward``) with the overlap off, ``build_schedule_plan`` with it on
(``preprocess_for_fine_grained_offloading``). The layers open and commit their offload groups themselves in the steps
the plan's nodes call (``_forward_attention``, the attention module, ``_forward_pre_mlp_layernorm`` with
``_forward_post_mlp``, the experts), and Megatron-Core's driver resets the manager after each step. So the plan makes
the chunk handler where Megatron-Core's plan makes it, when a microbatch's plan is built, and calls nothing else.
"""

import torch


def start_offloading(model: torch.nn.Module) -> None:
    """The offload manager's chunk handler for the microbatch ``model`` (a ``GPTModel`` or ``HybridModel``, a
    vision-language model's language model) is about to run forward, where Megatron-Core's plan makes it."""
    if getattr(model.config, "fine_grained_activation_offloading", False):
        model.preprocess_for_fine_grained_offloading()
