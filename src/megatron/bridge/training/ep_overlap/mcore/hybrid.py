"""Megatron-Core's ``HybridModel`` under the EP-overlap schedule: each MoE group is one of the schedule's layers.

Such a group is the layers after one MoE layer (run whole, as ``HybridStack.forward`` calls them), then the next
MoE layer.
"""

import torch
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.transformer.moe.moe_layer import MoELayer

from megatron.bridge.training.ep_overlap.mcore.base import McoreChunk
from megatron.bridge.training.ep_overlap.mcore.layer import McoreComputeRun, McoreLayer


def _is_moe(layer: torch.nn.Module) -> bool:
    return isinstance(getattr(layer, "mlp", None), MoELayer)


class McoreHybridChunk(McoreChunk):
    """A Megatron-Core ``HybridModel`` (or one pipeline chunk) as the EP-overlap engine runs it."""

    def __init__(self, model: torch.nn.Module, *, delay_wgrad: bool = False):
        if not isinstance(model, HybridModel):
            raise ValueError(f"{type(model).__name__}: McoreHybridChunk runs Megatron-Core's HybridModel")
        if model.mtp_num_depths > 0 and model.config.mtp_num_layers != model.mtp_num_depths:
            raise ValueError(
                f"hybrid_layer_pattern={model.hybrid_layer_pattern!r} has {model.mtp_num_depths} multi-token "
                f"prediction depth(s) and mtp_num_layers={model.config.mtp_num_layers}: the model would not compute "
                f"their loss; fix: set mtp_num_layers={model.mtp_num_depths}"
            )
        super().__init__(model, delay_wgrad=delay_wgrad)

    def _build_layers(self) -> tuple[list, list[int]]:
        groups, numbers, before = [], [], []
        for layer in self.model.decoder.layers:
            if not _is_moe(layer):
                before.append(layer)
                continue
            number = layer.layer_number - 1  # Megatron-Core counts from 1
            groups.append(McoreLayer(layer, number, self, before))
            numbers.append(number)
            before = []
        if before:
            number = before[-1].layer_number - 1
            groups.append(McoreComputeRun(before, number, self))
            numbers.append(number)
        return groups, numbers

    def _final_norm(self, x_SBH: torch.Tensor) -> torch.Tensor:
        decoder = self.model.decoder
        return decoder.final_norm(x_SBH) if decoder.post_layer_norm else x_SBH

    def embed_microbatch(
        self, tokens_BS: torch.Tensor, position_ids_BS: torch.Tensor | None = None, packed_seq_params=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``HybridModel.forward`` before the stack: the embedding and this microbatch's rotary embedding."""
        model = self.model
        positions = self._positions(tokens_BS) if position_ids_BS is None else position_ids_BS
        x_SBH = model.embedding(input_ids=tokens_BS, position_ids=positions)
        return x_SBH, self._rotary(x_SBH, packed_seq_params)

    def _rotary(self, x_SBH: torch.Tensor, packed_seq_params=None):
        model, kind = self.model, self.model.position_embedding_type
        if not ((kind == "rope" and not self.config.multi_latent_attention) or kind == "yarn"):
            return None
        length = model.rotary_pos_emb.get_rotary_seq_len(None, model.decoder, x_SBH, self.config, packed_seq_params)
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        emb = model.rotary_pos_emb(length, packed_seq=thd)
        return emb[0] if kind == "yarn" else emb  # yarn also returns its mscale
