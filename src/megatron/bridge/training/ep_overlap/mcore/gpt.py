"""Megatron-Core's ``GPTModel`` under the EP-overlap schedule: each decoder layer is one of the schedule's layers."""

import torch
from megatron.core.models.gpt import GPTModel

from megatron.bridge.training.ep_overlap.mcore.base import McoreChunk
from megatron.bridge.training.ep_overlap.mcore.layer import McoreLayer


class McoreGPTChunk(McoreChunk):
    """A Megatron-Core ``GPTModel`` (or one pipeline chunk) as the EP-overlap engine runs it."""

    def __init__(self, model: torch.nn.Module, *, delay_wgrad: bool = False):
        if not isinstance(model, GPTModel):
            raise ValueError(
                f"{type(model).__name__}: McoreGPTChunk runs Megatron-Core's GPTModel (whole or a pipeline chunk); "
                "fix: use megatron.bridge.training.ep_overlap.mcore.chunk_for(model), which also takes a HybridModel"
            )
        super().__init__(model, delay_wgrad=delay_wgrad)

    def _build_layers(self) -> tuple[list, list[int]]:
        decoder = self.model.decoder
        numbers = [layer.layer_number - 1 for layer in decoder.layers]  # Megatron-Core counts from 1
        layers = [McoreLayer(layer, i, self) for i, layer in zip(numbers, decoder.layers)]
        if layers and decoder.final_layernorm is not None and not self.post_process:
            # With MTP, Megatron-Core puts the final norm on the last decoder layer's stage, maybe not the loss's.
            layers[-1] = _FinalNormLayer(decoder.layers[-1], numbers[-1], self)
        return layers, numbers

    def _final_norm(self, x_SBH: torch.Tensor) -> torch.Tensor:
        """The decoder's final norm where this loss chunk's block holds it (else the last layer's chunk applied it)."""
        norm = self.model.decoder.final_layernorm
        return x_SBH if norm is None or not self.post_process else norm(x_SBH)

    def embed_microbatch(
        self, tokens_BS: torch.Tensor, position_ids_BS: torch.Tensor | None = None, packed_seq_params=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``GPTModel._preprocess``: the embedding, and the rotary embedding this microbatch's layers read."""
        positions = self._positions(tokens_BS) if position_ids_BS is None else position_ids_BS
        x_SBH, rotary_pos_emb, *_ = self.model._preprocess(
            input_ids=tokens_BS, position_ids=positions, packed_seq_params=packed_seq_params
        )
        return x_SBH, rotary_pos_emb

    def _rotary(self, x_SBH: torch.Tensor, packed_seq_params=None):
        """``GPTModel._preprocess`` given the hidden states: only its rotary embedding."""
        _, rotary_pos_emb, *_ = self.model._preprocess(
            input_ids=None, position_ids=None, decoder_input=x_SBH, packed_seq_params=packed_seq_params
        )
        return rotary_pos_emb


class _FinalNormLayer(McoreLayer):
    """The last layer of a chunk holding the decoder's final norm but not the loss: normed after ``combine``."""

    def __call__(self, x_SBH: torch.Tensor) -> torch.Tensor:
        return self.chunk.model.decoder.final_layernorm(super().__call__(x_SBH))

    def combine(self, back, shared, h, routing) -> torch.Tensor:
        return self.chunk.model.decoder.final_layernorm(super().combine(back, shared, h, routing))
