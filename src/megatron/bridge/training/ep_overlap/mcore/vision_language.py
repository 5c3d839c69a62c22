"""Megatron-Bridge's ``Qwen3VLModel`` (Qwen3-VL, Qwen3.5-VL) under the EP-overlap schedule (Megatron-Core's driver).

The language model's layers are the schedule's, with a ``GPTModel``'s head; the embed step runs the vision tower and
merges images as ``Qwen3VLModel.forward`` does; mrope positions are computed per microbatch (Bridge's
``get_rope_index``).
Bridge's VL classes are never imported here (:func:`is_vision_language` looks them up in ``sys.modules``).
"""

import sys

import torch
from megatron.core import tensor_parallel

from megatron.bridge.training.ep_overlap.mcore.gpt import McoreGPTChunk
from megatron.bridge.training.ep_overlap.mcore.layer import McoreLayer
from megatron.bridge.training.ep_overlap.mcore.refusals import refuse_vision_language

_MODEL_MODULE = "megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model"
_ROPE_MODULE = "megatron.bridge.models.qwen_vl.modelling_qwen3_vl.rope"
_UTILS_MODULE = "megatron.bridge.models.qwen_vl.modelling_qwen3_vl.utils"
_PATCH = "tools/upstream.py patch: its qwen3_vl_step hunk passes them"
_OFF = "or turn overlap_moe_expert_parallel_comm off for this model"


def is_vision_language(model: torch.nn.Module) -> bool:
    """Whether ``model`` is Megatron-Bridge's ``Qwen3VLModel`` (the class exists only once its module is imported)."""
    module = sys.modules.get(_MODEL_MODULE)
    return module is not None and isinstance(model, module.Qwen3VLModel)


class _WithDeepstackGrads(torch.autograd.Function):
    """The embed output; its backward also returns the deepstack copies' gradients (one vision tower backward)."""

    @staticmethod
    def forward(ctx, x_SBH, cut, *features):
        ctx.cut = cut
        return x_SBH.clone()  # a new tensor: autograd treats an input returned as it is as a view of it

    @staticmethod
    def backward(ctx, grad_SBH):
        return (grad_SBH, None, *(leaf.grad for leaf in ctx.cut))


class _DeepstackLayer(McoreLayer):
    """Adds deepstack feature ``feature`` at the image tokens after ``combine``, as the language block does."""

    def __init__(self, layer: torch.nn.Module, index: int, chunk, feature: int):
        super().__init__(layer, index, chunk)
        self.feature = feature

    def __call__(self, x_SBH: torch.Tensor) -> torch.Tensor:
        return self._with_feature(super().__call__(x_SBH))

    def combine(self, back, shared, h, routing) -> torch.Tensor:
        return self._with_feature(super().combine(back, shared, h, routing))

    def _with_feature(self, x_SBH: torch.Tensor) -> torch.Tensor:
        features = getattr(self.chunk, "deepstack", None)
        if not features or self.feature >= len(features):
            return x_SBH
        decoder = self.chunk.model.decoder
        return decoder._deepstack_process(x_SBH, self.chunk.visual_pos_masks, features[self.feature])


class VisionLanguageMicrobatch:
    """One microbatch of a VL plan: the driver's view with its multimodal inputs, image mask and deepstack features."""

    def __init__(self, chunk: "McoreVisionLanguageChunk", view, input_ids: torch.Tensor, inputs: dict):
        self.view, self.input_ids, self.inputs = view, input_ids, inputs
        # On the view, so the bound layers and the view's head (its MTP layer) read the one rotary embedding.
        view.rotary_pos_emb = chunk.rotary_for_microbatch(input_ids, view.position_ids, inputs)
        if getattr(view, "loss_mask", None) is not None:  # the MTP loss's mask, split as the model splits it
            view.loss_mask = chunk.context_part(view.loss_mask, input_ids.shape[1])
        self.visual_pos_masks, self.deepstack = None, None
        self.layers = [layer.bound_to(self) for layer in chunk.layers]

    def __getattr__(self, name: str):
        return getattr(self.view, name)

    def head_loss(self, x_SBH, labels_BS, normalizer, tokens_BS=None) -> torch.Tensor:
        """The view's loss on this rank's part of the labels and of the tokens (which the MTP layer embeds), as the
        model's forward gives its language model (with context parallelism, parts of a whole sequence)."""
        part, length = self.view.chunk.context_part, self.input_ids.shape[1]
        return self.view.head_loss(x_SBH, part(labels_BS, length), normalizer, part(tokens_BS, length))

    def embed(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        x_SBH, self.visual_pos_masks, features = self.view.chunk.embed_images(tokens_BS, self.inputs)
        if not features:
            return x_SBH
        self.deepstack = [feature.detach().requires_grad_(feature.requires_grad) for feature in features]
        return _WithDeepstackGrads.apply(x_SBH, self.deepstack, *features)


class McoreVisionLanguageChunk(McoreGPTChunk):
    """Bridge's ``Qwen3VLModel`` as the plan runs it; ``self.model`` is its language model (a ``GPTModel``)."""

    multimodal_rotary = True
    bound_inputs = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")

    def __init__(self, model: torch.nn.Module, *, delay_wgrad: bool = False):
        if not is_vision_language(model):
            raise ValueError(f"{type(model).__name__}: McoreVisionLanguageChunk runs Megatron-Bridge's Qwen3VLModel")
        refuse_vision_language(model)
        self.vision_language = model
        self.vision = model.vision_model if model.pre_process else None
        vision_config = model.vision_transformer_config
        self.deepstack_count = len(getattr(vision_config, "deepstack_visual_indexes", None) or ())
        super().__init__(model.language_model, delay_wgrad=delay_wgrad)

    def _build_layers(self) -> tuple[list, list[int]]:
        layers = self.model.decoder.layers
        if self.pre_process and self.deepstack_count > len(layers):
            raise ValueError(
                f"{self.deepstack_count} deepstack features and {len(layers)} language layers on the first pipeline "
                "chunk: the language model adds deepstack feature i after layer i of the chunk with the vision tower "
                "(Megatron-Bridge's model passes none across pipeline stages); fix: put at least "
                f"{self.deepstack_count} layers on the first chunk, {_OFF}"
            )
        scheduled, numbers = [], []
        for position, layer in enumerate(layers):
            number = layer.layer_number - 1  # Megatron-Core counts from 1
            deepstack = self.pre_process and position < self.deepstack_count
            scheduled.append(
                _DeepstackLayer(layer, number, self, position) if deepstack else McoreLayer(layer, number, self)
            )
            numbers.append(number)
        return scheduled, numbers

    def parameters(self):
        return self.vision_language.parameters()

    def named_parameters(self):
        return self.vision_language.named_parameters()

    def input_problems(self, input_ids: torch.Tensor | None, inputs: dict, packed_seq_params=None) -> list[str]:
        if input_ids is None:
            return [
                "input_ids are required on every chunk of a vision-language model (its multimodal rotary positions "
                "are computed from them)"
            ]
        problems = []
        if packed_seq_params is not None:
            problems.append(
                "packed_seq_params with a vision-language model (Qwen3-VL in-batch packing) is not scheduled by the "
                f"plan; fix: set dataset.enable_in_batch_packing=False, {_OFF}"
            )
        vl = self.vision_language
        for kind, token, pixels, grid in (
            ("image", vl.image_token_id, "pixel_values", "image_grid_thw"),
            ("video", vl.video_token_id, "pixel_values_videos", "video_grid_thw"),
        ):
            count = int((input_ids == token).sum())
            needed = ([pixels] if self.pre_process else []) + [grid]
            absent = [name for name in needed if inputs.get(name) is None]
            if count and absent:
                problems.append(
                    f"{', '.join(absent)}: input_ids hold {count} {kind} tokens (id {token}) but build_schedule_plan "
                    f"was not given {' or '.join(absent)} (Megatron-Bridge 0.6.2's qwen3_vl_step passes them to the "
                    f"plain forward only), so with overlap these {kind}s would train as text; fix: apply this "
                    f"project's patch ({_PATCH}), {_OFF}"
                )
            elif self.pre_process and inputs.get(pixels) is not None and inputs.get(grid) is None:
                problems.append(f"{pixels} without {grid}: the vision tower needs each {kind}'s grid; fix: pass it")
        return problems

    def bind_inputs(self, view, input_ids: torch.Tensor, inputs: dict) -> VisionLanguageMicrobatch:
        return VisionLanguageMicrobatch(self, view, input_ids, inputs)

    def rotary_for_microbatch(self, input_ids: torch.Tensor, position_ids, inputs: dict):
        """The multimodal rotary embedding, from 3 x B x S ``position_ids`` or else ``get_rope_index``."""
        rope = sys.modules[_ROPE_MODULE]
        if not (isinstance(position_ids, torch.Tensor) and position_ids.dim() == 3 and position_ids.shape[0] == 3):
            vl = self.vision_language
            position_ids, _ = rope.get_rope_index(
                self.config.spatial_merge_size,
                vl.image_token_id,
                vl.video_token_id,
                vl.vision_start_token_id,
                input_ids,
                image_grid_thw=inputs.get("image_grid_thw"),
                video_grid_thw=inputs.get("video_grid_thw"),
            )
        # As the model's forward: this rank's part of whole-sequence positions, which the rotary embedding then takes
        # as they are (its 'THD' flag; else it would split them again).
        split = self.context_part(position_ids, input_ids.shape[1], dim=2)
        self.model.rotary_pos_emb.is_thd_format = split is not position_ids
        position_ids = split
        # The language model's own preprocessing (given hidden states, it embeds nothing): its rotary embedding.
        given = torch.empty(0, device=input_ids.device)
        _, rotary_pos_emb, *_ = self.model._preprocess(input_ids=None, position_ids=position_ids, decoder_input=given)
        return rotary_pos_emb

    def embed_images(self, tokens_BS: torch.Tensor, inputs: dict) -> tuple[torch.Tensor, torch.Tensor | None, list]:
        """``Qwen3VLModel.forward`` before the first layer: hidden states, image mask [B, S], deepstack features."""
        vl, utils = self.vision_language, sys.modules[_UTILS_MODULE]
        pixels, grid, mask_BS = utils.reorganize_inputs(
            input_ids=tokens_BS,
            pixel_values=inputs.get("pixel_values"),
            pixel_values_videos=inputs.get("pixel_values_videos"),
            image_grid_thw=inputs.get("image_grid_thw"),
            video_grid_thw=inputs.get("video_grid_thw"),
            image_token_id=vl.image_token_id,
            video_token_id=vl.video_token_id,
            square_merge_size=vl.square_merge_size,
        )
        images, features = None, []
        if grid is not None and grid.shape[0] > 0:
            images, features = self._vision_tower(pixels, grid)
        # Every token's word embedding (no position ids: they are rotary), copied to write image embeddings in place.
        x_SBH = self.model.embedding(input_ids=tokens_BS, position_ids=None).clone()
        if images is None:
            return self._sequence_part(x_SBH, None, [])
        x_BSH = x_SBH.transpose(0, 1).contiguous()
        x_BSH[mask_BS] = images
        return self._sequence_part(x_BSH.transpose(0, 1).contiguous(), mask_BS, list(features or []))

    def _vision_tower(self, pixels: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Image embeddings and deepstack features, as the model's forward gets them from its vision tower: with
        ``vision_dp_when_cp``, each context-parallel rank runs its share of the images and all ranks gather them."""
        vl, utils = self.vision_language, sys.modules[_UTILS_MODULE]
        cp = vl.pg_collection.cp
        spread = cp.size() > 1 and vl.config.vision_dp_when_cp
        if spread:
            pixels, grid, counts, padded = utils.qwen3vl_cp_split(cp.size(), pixels, grid)
            pixels, grid, lengths = utils.get_vision_cp_data(
                pixels, grid, vl.square_merge_size, counts, padded, cp.rank(), cp.size()
            )
            grid = utils.collapse_thw(grid)
        if pixels.shape[0] > 0:
            images, features = self.vision(hidden_states=pixels, grid_thw=grid)
        else:  # no pixels here: empty embeddings and features, as in the model's forward
            config, hidden = self.config, self.config.hidden_size
            empty = dict(device=pixels.device, dtype=config.params_dtype)
            images = torch.zeros((0, hidden), **empty)
            features = [
                torch.zeros((0, hidden), **empty) for _ in vl.vision_transformer_config.deepstack_visual_indexes
            ]
        if not spread:
            return images, list(features or [])
        utils.ensure_requires_grad_for_cp_collective((images, *features))
        gather = utils.AllGatherVisionEmbeddings.apply
        return gather(images, lengths, cp), [gather(feature, lengths, cp) for feature in features]

    def context_part(self, x: torch.Tensor | None, length: int, dim: int = 1) -> torch.Tensor | None:
        """With context parallelism, this rank's zigzag part of ``x`` along ``dim`` where that still has the whole
        sequence's ``length`` (as the model's forward splits its input ids, labels, loss mask and positions)."""
        cp = self.vision_language.pg_collection.cp
        if x is None or cp.size() == 1 or x.shape[dim] != length:
            return x
        return sys.modules[_UTILS_MODULE].split_data_cp_rank(x, cp.size(), dim, cp.rank())

    def _sequence_part(self, x_SBH: torch.Tensor, mask_BS, features: list):
        """This rank's part of the merged embeddings, image mask and deepstack features, as the model's forward splits
        them: over the context-parallel ranks (zigzag), then scattered over the tensor-parallel ones with sequence
        parallelism (its embedding splits nothing itself)."""
        groups, sp = self.vision_language.pg_collection, self.config.sequence_parallel
        cp, tp = groups.cp, groups.tp
        if cp.size() == 1 and not sp:
            return x_SBH, mask_BS, features
        x_SBH = self.context_part(x_SBH, x_SBH.shape[0], dim=0)  # the whole sequence: split with CP
        if sp:
            x_SBH = tensor_parallel.scatter_to_sequence_parallel_region(x_SBH, group=tp).contiguous()
        if mask_BS is not None:
            mask_BS, features = sys.modules[_UTILS_MODULE].split_deepstack_embs(
                mask_BS,
                features,
                tp_size=tp.size(),
                tp_rank=tp.rank(),
                cp_size=cp.size(),
                cp_rank=cp.rank(),
                sequence_parallel=sp,
            )
        return x_SBH, mask_BS, list(features or [])

    def _mtp_embedding(self, aliases: dict):
        """With sequence parallelism, the MTP block's embedding scattered as Bridge's language model scatters it (its
        embedding scatters nothing itself)."""
        embed = super()._mtp_embedding(aliases)
        if not self.config.sequence_parallel:
            return embed
        tp = self.vision_language.pg_collection.tp
        return lambda **inputs: tensor_parallel.scatter_to_sequence_parallel_region(embed(**inputs), group=tp)

    def embed_microbatch(
        self, tokens_BS: torch.Tensor, position_ids_BS: torch.Tensor | None = None, packed_seq_params=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A text-only microbatch's embedding and rotary embedding (with images: :class:`VisionLanguageMicrobatch`)."""
        rotary_pos_emb = self.rotary_for_microbatch(tokens_BS, position_ids_BS, {})
        return self.embed_images(tokens_BS, {})[0], rotary_pos_emb

    def _rotary(self, x_SBH: torch.Tensor, packed_seq_params=None):
        return None
