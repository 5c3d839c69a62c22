"""Megatron-Bridge's vision-language model (``Qwen3VLModel``: Qwen3-VL, Qwen3.5-VL) under the EP-overlap schedule.

Contract:
    * :class:`McoreVisionLanguageChunk` runs a ``Qwen3VLModel`` (whole, or one pipeline chunk) whose language model is
      a ``GPTModel`` (Bridge's ``Qwen3VLGPTModel``): its decoder layers are the schedule's units and the head is the
      language model's, as for a ``GPTModel`` (:class:`~megatron.bridge.training.ep_overlap.mcore.gpt.McoreGPTChunk`).
      Bridge's VL classes are not imported here: a model is recognized by its class, whose module is loaded once one
      exists (:func:`is_vision_language`), so this module also loads where Bridge's models are absent.
    * A microbatch's images (``pixel_values``, ``image_grid_thw``; videos the same way) are bound to it when
      Megatron-Core's driver builds its plan (:meth:`McoreVisionLanguageChunk.bind_inputs`). On the chunk with the
      embedding, its embed step runs the vision tower, unpaired like the embedding, and writes the image embeddings
      over the image tokens' word embeddings, with the model's own functions (``reorganize_inputs``, its
      ``vision_model``, the language embedding), as ``Qwen3VLModel.forward`` does before the first layer.
    * Multimodal rotary positions: on every chunk, per microbatch, from its input ids and grids (Bridge's
      ``get_rope_index``) or as given (``position_ids`` of shape 3 x B x S), through the language model's multimodal
      rotary embedding, as the model's forward computes them on every pipeline stage; every layer's attention reads
      them. Other position ids are ignored, as the model ignores them.
    * Deepstack (Qwen3-VL): the vision tower's i-th deepstack feature is added to the image tokens' hidden states right
      after the i-th layer of the chunk with the vision tower, with the language block's own ``_deepstack_process``,
      where the plain block adds it. Bridge's model passes no deepstack feature across pipeline stages: it asserts
      when built that those layers are on that chunk; the plan refuses the same by name. The features enter the
      units cut from the vision tower's graph; their gradients join the embedding step's backward, so the vision
      tower runs its backward once per microbatch, as in the plain path.
    * Qwen3.5's gated attention output and shared-expert gate are computed inside the attention module and the MoE
      layer's shared experts, which the plan runs as the plain path does.
    * A text-only microbatch (no pixel values, no image tokens) runs the language model alone, as the model's forward
      does; text-only microbatches and ones with images mix freely in a step.
    * Full recompute (the hook's ``full_recompute`` keyword) replays each recomputed layer's nodes before its
      backward, the deepstack additions with them, as the language block's checkpointed forward recomputes them.
    * One MTP layer (every Qwen3.5-VL recipe has one) runs in the head of the last stage, with the microbatch's
      multimodal rotary embedding, as the language model's forward passes its MTP block.
    * Refused when the plan is built (``refusals.refuse_vision_language``), each in one line with its fix: the vision
      tower and the language model on different ranks (``dist_train``), sequence parallelism (the model scatters its
      merged embeddings and splits the deepstack features), context parallelism, the vision tower's CUDA graphs.
      Refused when a microbatch is bound (one line each, before any compute): packed sequences, input ids holding image
      (video) tokens whose pixel values or grids did not reach the plan (stock Megatron-Bridge 0.6.2's
      ``qwen3_vl_step`` passes them to the plain forward only: the fix is this project's patch), no input ids. The plan
      reads only what it is given, never its caller's frames."""

import sys

import torch

from megatron.bridge.training.ep_overlap.mcore.gpt import McoreGPTChunk
from megatron.bridge.training.ep_overlap.mcore.layer import McoreLayer
from megatron.bridge.training.ep_overlap.mcore.refusals import refuse_vision_language

_MODEL_MODULE = "megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model"
_ROPE_MODULE = "megatron.bridge.models.qwen_vl.modelling_qwen3_vl.rope"
_UTILS_MODULE = "megatron.bridge.models.qwen_vl.modelling_qwen3_vl.utils"
_PATCH = "tools/upstream.py patch: its qwen3_vl_step hunk passes them"
_OFF = "or turn overlap_moe_expert_parallel_comm off for this model"


def is_vision_language(model: torch.nn.Module) -> bool:
    """Whether ``model`` is Megatron-Bridge's ``Qwen3VLModel`` (a model of that class exists only where its module
    was imported)."""
    module = sys.modules.get(_MODEL_MODULE)
    return module is not None and isinstance(model, module.Qwen3VLModel)


class _WithDeepstackGrads(torch.autograd.Function):
    """The embedding step's output, whose backward also hands the deepstack features the gradients their units
    left on the cut copies, so one backward pass runs through the vision tower for all its outputs, as autograd
    runs it in the plain path."""

    @staticmethod
    def forward(ctx, x_SBH, cut, *features):
        ctx.cut = cut
        return x_SBH.clone()  # a new tensor: autograd treats an input returned as it is as a view of it

    @staticmethod
    def backward(ctx, grad_SBH):
        return (grad_SBH, None, *(leaf.grad for leaf in ctx.cut))


class _DeepstackLayer(McoreLayer):
    """A layer of the chunk with the vision tower whose output gets the ``feature``-th deepstack feature added at the
    image tokens, as the language block adds it: after ``combine`` (the layer's last node; a replay's too), or after
    the whole layer in the plain path."""

    def __init__(self, layer: torch.nn.Module, index: int, chunk, feature: int):
        super().__init__(layer, index, chunk)
        self.feature = feature

    def __call__(self, x_SBH: torch.Tensor) -> torch.Tensor:
        return self._with_feature(super().__call__(x_SBH))

    def combine(self, back, shared, h, routing) -> torch.Tensor:
        return self._with_feature(super().combine(back, shared, h, routing))

    def _with_feature(self, x_SBH: torch.Tensor) -> torch.Tensor:
        features = getattr(self.chunk, "deepstack", None)  # the microbatch's (None: no images)
        if not features or self.feature >= len(features):
            return x_SBH
        decoder = self.chunk.model.decoder
        return decoder._deepstack_process(x_SBH, self.chunk.visual_pos_masks, features[self.feature])


class VisionLanguageMicrobatch:
    """One microbatch of a vision-language plan: the driver's view of it (attention and loss masks, the head) with
    its multimodal inputs, its rotary embedding, and after the embed step its image positions and deepstack features
    (cut from the vision tower's graph, see the module docstring). The plan's units are bound to it."""

    def __init__(self, chunk: "McoreVisionLanguageChunk", view, input_ids: torch.Tensor, inputs: dict):
        self.view, self.input_ids, self.inputs = view, input_ids, inputs
        # Kept on the view (read here through __getattr__): the bound layers and the view's head, whose MTP layer
        # reads it, see the one rotary embedding.
        view.rotary_pos_emb = chunk.rotary_for_microbatch(input_ids, view.position_ids, inputs)
        self.visual_pos_masks, self.deepstack = None, None
        self.layers = [layer.bound_to(self) for layer in chunk.layers]

    def __getattr__(self, name: str):
        return getattr(self.view, name)

    def embed(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        x_SBH, self.visual_pos_masks, features = self.view.chunk.embed_images(tokens_BS, self.inputs)
        if not features:
            return x_SBH
        self.deepstack = [feature.detach().requires_grad_(feature.requires_grad) for feature in features]
        return _WithDeepstackGrads.apply(x_SBH, self.deepstack, *features)


class McoreVisionLanguageChunk(McoreGPTChunk):
    """Megatron-Bridge's ``Qwen3VLModel`` (or one pipeline chunk of it) as the EP-overlap plan runs it (see the
    module docstring). ``model`` is the language model (Megatron-Core's ``GPTModel``), ``vision_language`` the
    whole model.

    Args:
        model: The ``Qwen3VLModel``, whole or one pipeline chunk (Bridge builds one per virtual stage).
        delay_wgrad: Whether the plan runs with delayed wgrad (see :class:`McoreChunk`).
    """

    multimodal_rotary = True  # refusals: this plan computes 'mrope' positions
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

    def _build_units(self) -> tuple[list, list[int]]:
        """The language model's decoder layers; on the chunk with the vision tower, the first ones add the
        deepstack features."""
        layers = self.model.decoder.layers
        if self.pre_process and self.deepstack_count > len(layers):
            raise ValueError(
                f"{self.deepstack_count} deepstack features and {len(layers)} language layers on the first pipeline "
                "chunk: the language model adds deepstack feature i after layer i of the chunk with the vision tower "
                "(Megatron-Bridge's model passes none across pipeline stages); fix: put at least "
                f"{self.deepstack_count} layers on the first chunk, {_OFF}"
            )
        units, numbers = [], []
        for position, layer in enumerate(layers):
            number = layer.layer_number - 1  # Megatron-Core counts from 1
            deepstack = self.pre_process and position < self.deepstack_count
            unit = _DeepstackLayer(layer, number, self, position) if deepstack else McoreLayer(layer, number, self)
            units.append(unit)
            numbers.append(number)
        return units, numbers

    def parameters(self):
        return self.vision_language.parameters()

    def named_parameters(self):
        return self.vision_language.named_parameters()

    # ---- one microbatch -----------------------------------------------------------------------------------------

    def input_problems(self, input_ids: torch.Tensor | None, inputs: dict, packed_seq_params=None) -> list[str]:
        """What keeps the plan from running this microbatch as the model's forward would (empty when it can)."""
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
            needed = ([pixels] if self.pre_process else []) + [grid]  # the pixels where the vision tower runs
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
        """The microbatch ``view`` with its multimodal inputs bound (see :class:`VisionLanguageMicrobatch`)."""
        return VisionLanguageMicrobatch(self, view, input_ids, inputs)

    def rotary_for_microbatch(self, input_ids: torch.Tensor, position_ids, inputs: dict):
        """The multimodal rotary embedding the layers read for this microbatch: from ``position_ids`` when they are
        multimodal ones (3 x B x S), else from the input ids and grids, as the model's forward computes them."""
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
        self.model.rotary_pos_emb.is_thd_format = False  # as the model's forward sets it for unpacked sequences
        # The language model's own preprocessing (given hidden states, it embeds nothing): its rotary embedding.
        given = torch.empty(0, device=input_ids.device)
        _, rotary_pos_emb, *_ = self.model._preprocess(input_ids=None, position_ids=position_ids, decoder_input=given)
        return rotary_pos_emb

    def embed_images(self, tokens_BS: torch.Tensor, inputs: dict) -> tuple[torch.Tensor, torch.Tensor | None, list]:
        """What ``Qwen3VLModel.forward`` does before the first language layer: the vision tower on the microbatch's
        images, their embeddings written over the image tokens' word embeddings. Returns the hidden states
        [S, B, H], the image tokens' positions [B, S] (None without images) and the deepstack features (empty
        without)."""
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
            if pixels.shape[0] > 0:
                images, features = self.vision(hidden_states=pixels, grid_thw=grid)
            else:  # grids without pixels: no image token gets an embedding, as in the model's forward
                config = self.config
                images = torch.zeros((0, config.hidden_size), device=pixels.device, dtype=config.params_dtype)
        # The word embeddings of every token (the language model's position ids are its rotary ones: none here),
        # copied so the image embeddings can be written in place.
        x_SBH = self.model.embedding(input_ids=tokens_BS, position_ids=None).clone()
        if images is None:
            return x_SBH, None, []
        x_BSH = x_SBH.transpose(0, 1).contiguous()
        x_BSH[mask_BS] = images
        return x_BSH.transpose(0, 1).contiguous(), mask_BS, list(features or [])

    def embed_microbatch(
        self, tokens_BS: torch.Tensor, position_ids_BS: torch.Tensor | None = None, packed_seq_params=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A text-only microbatch's embedding and rotary embedding (a microbatch with images is embedded by its
        :class:`VisionLanguageMicrobatch`)."""
        rotary_pos_emb = self.rotary_for_microbatch(tokens_BS, position_ids_BS, {})
        return self.embed_images(tokens_BS, {})[0], rotary_pos_emb

    def _rotary(self, x_SBH: torch.Tensor, packed_seq_params=None):
        """None: the rotary embedding is each microbatch's (:meth:`rotary_for_microbatch`)."""
        return None
