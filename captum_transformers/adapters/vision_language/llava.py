"""LLaVA (HF ``LlavaForConditionalGeneration``): a CLIP- or SigLIP-style vision tower feeding a causal LM.

The tower's hidden state at ``vision_feature_layer`` goes through the projector (linear,
activation, linear: one token at a time) and replaces the ``image_token_id`` placeholders of
``input_ids``, image after image. The ``"default"`` strategy drops the tower's first token,
``"full"`` keeps every token. Decoder image token ``k`` of an image is therefore vision token
``k + 1`` (``"default"``) or ``k`` (``"full"``) of its row of the tower: a one-hot ``token_map``.

* CLIP tower (``CLIPVisionModel``): a CLS token, then the patch grid; ``"default"`` drops CLS.
* SigLIP tower (``SiglipVisionModel``, no CLS): the patch grid only; ``"default"`` drops the
  grid's first patch (top-left), as HF's model does: that patch feeds no image token, so its
  share of ``image_attr`` is what reaches it through the tower's attention only.

Refused: several feature layers (their features are concatenated, so a decoder token comes
from several hidden states), ``image_sizes`` (crops of one image), another tower class, and
LLaVA-NeXT / LLaVA-OneVision (:data:`TILED_FAMILIES`: each image is tiled into crops at several
resolutions plus newline tokens, not mapped back to the one image).

Example::

    >>> adapter = LlavaAdapter()
    >>> adapter.images(llava, input_ids, {"pixel_values": pixels})[0].grid     # (4, 4)
"""
from __future__ import annotations

from typing import Any, List, Mapping, Sequence

import torch
from torch import nn

from ...errors import InputError, UnsupportedModelError
from .base import IMAGE_STREAM, TEXT_STREAM, ImageTokens, VisionLanguageAdapter, placeholders_per_image


def _config(model: nn.Module) -> Any:
    from ..huggingface.adapter import pretrained_model

    return pretrained_model(model).config


#: Towers whose token layout is known: whether a CLS token precedes the patch grid.
TOWER_CLS = {"CLIPVisionModel": True, "SiglipVisionModel": False}
#: LLaVA variants registered to this adapter only to be refused (model_type: class name).
TILED_FAMILIES = {"llava_next": "LlavaNextForConditionalGeneration",
                  "llava_next_video": "LlavaNextVideoForConditionalGeneration",
                  "llava_onevision": "LlavaOnevisionForConditionalGeneration"}


class LlavaAdapter(VisionLanguageAdapter):
    """``LlavaForConditionalGeneration`` (see the module docstring)."""

    name = "llava"
    families = "LLaVA (LlavaForConditionalGeneration: CLIP or SigLIP vision tower, projector, causal LM)"
    stream_components: Mapping[str, str] = {"vision_tower": IMAGE_STREAM, "language_model": TEXT_STREAM}
    #: image_sizes is taken only to be refused with its reason (it is not silently dropped).
    image_input_names = ("pixel_values", "image_sizes")

    @staticmethod
    def refuse_tiled(model: nn.Module) -> None:
        """Raise for LLaVA-NeXT / -OneVision: their image tokens come from several crops of each image."""
        model_type = getattr(_config(model), "model_type", "")
        if model_type in TILED_FAMILIES:
            raise UnsupportedModelError(
                f"{TILED_FAMILIES[model_type]} is not supported: it tiles each image into crops at several "
                "resolutions (image_grid_pinpoints, anyres) and adds newline tokens between rows, so its image tokens "
                "are not mapped back to one image's patches. Explain a LlavaForConditionalGeneration (one crop per "
                "image), or pass adapter=YourAdapter() that maps the crops back.")

    def blocks(self, model: nn.Module):
        self.refuse_tiled(model)
        return super().blocks(model)

    def capture(self, model: nn.Module, recorder: Any):
        self.refuse_tiled(model)
        return super().capture(model, recorder)

    def propagation(self, model: nn.Module, rules: Any):
        self.refuse_tiled(model)
        return super().propagation(model, rules)

    def _checked_config(self, model: nn.Module) -> Any:
        self.refuse_tiled(model)
        config = _config(model)
        layer = getattr(config, "vision_feature_layer", -2)
        if not isinstance(layer, int):
            raise InputError(f"vision_feature_layer={layer!r} concatenates several hidden states of the vision tower "
                             "into each image token; only one feature layer (an int) is mapped back to the patches.")
        strategy = getattr(config, "vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise InputError(f"vision_feature_select_strategy={strategy!r} is not LLaVA's 'default' or 'full'.")
        return config

    def has_cls(self, model: nn.Module) -> bool:
        """Whether the tower puts a CLS token before the patch grid (CLIP) or not (SigLIP)."""
        tower = type(self.vision_tower(model)).__name__
        if tower not in TOWER_CLS:
            raise InputError(f"The vision tower is a {tower}; its token layout (a CLS token or not, the patch grid) "
                             f"is known for {sorted(TOWER_CLS)} only, so its image tokens are not mapped back to the "
                             "patches. Use a LLaVA with one of those towers.")
        return TOWER_CLS[tower]

    def check_image_inputs(self, model: nn.Module, image_inputs: Mapping[str, Any]) -> None:
        self._checked_config(model)
        self.has_cls(model)
        if image_inputs.get("image_sizes") is not None:
            raise InputError("image_sizes (LLaVA-NeXT-style crops of one image, or Pixtral's sizes) are not mapped "
                             "back to the image; give one pixel_values entry (C, H, W) per image, without "
                             "image_sizes.")

    def vision_tower(self, model: nn.Module) -> nn.Module:
        return _find(model, "vision_tower")

    def projector(self, model: nn.Module) -> nn.Module:
        return _find(model, "multi_modal_projector")

    def image_token_id(self, model: nn.Module) -> int:
        return int(_config(model).image_token_id)

    def feeding_calls(self, model: nn.Module) -> int:
        """Layers run before ``hidden_states[vision_feature_layer]`` (index 0: the embeddings)."""
        config = self._checked_config(model)
        layers = int(config.vision_config.num_hidden_layers)
        layer = int(config.vision_feature_layer)
        return layer if layer >= 0 else layers + 1 + layer

    def images(self, model: nn.Module, input_ids: torch.Tensor, image_inputs: Mapping[str, Any]) -> List[ImageTokens]:
        self.check_image_inputs(model, image_inputs)
        config = _config(model)
        pixels = image_inputs.get("pixel_values")
        if not isinstance(pixels, torch.Tensor) or pixels.dim() != 4 or not pixels.is_floating_point():
            raise InputError(f"LLaVA's images are pixel_values (images, C, H, W) in floating point; got "
                             f"{type(pixels).__name__} {tuple(getattr(pixels, 'shape', ()))}.")
        patch = int(config.vision_config.patch_size)
        height, width = int(pixels.shape[-2]), int(pixels.shape[-1])
        grid = (height // patch, width // patch)
        cls = 1 if self.has_cls(model) else 0
        vision_tokens = grid[0] * grid[1] + cls
        dropped = 1 if config.vision_feature_select_strategy == "default" else 0  # CLIP: CLS; SigLIP: a patch
        per_image = vision_tokens - dropped
        found = self.image_token_positions(model, input_ids)
        if len(found) != per_image * pixels.shape[0]:
            raise InputError(f"input_ids hold {len(found)} image tokens (id {self.image_token_id(model)}) but "
                             f"{pixels.shape[0]} image(s) of {height}x{width} give {per_image} tokens each; expand "
                             "each image's placeholder to its number of tokens (as LlavaProcessor does).")
        token_map = torch.zeros(per_image, vision_tokens, dtype=torch.float64)
        token_map[torch.arange(per_image), torch.arange(per_image) + dropped] = 1.0
        cells = torch.arange(cls, vision_tokens)
        images = [ImageTokens(example, positions, i, (0, vision_tokens), token_map, grid, cells, (height, width))
                  for i, (example, positions) in enumerate(placeholders_per_image(found, [per_image] * len(pixels)))]
        return images

    def pixel_relevance(self, model: nn.Module, products: Mapping[str, torch.Tensor],
                        images: Sequence[ImageTokens]) -> List[torch.Tensor]:
        summed = products["pixel_values"].sum(1)  # (images, H, W)
        return [summed[image.vision_row] for image in images]


def _find(model: nn.Module, name: str) -> nn.Module:
    for path, module in model.named_modules():
        if path.split(".")[-1] == name:
            return module
    raise InputError(f"{type(model).__name__} has no {name!r} module; it is not a LLaVA model.")
