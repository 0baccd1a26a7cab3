r"""Gemma 3 (HF ``Gemma3ForConditionalGeneration``): a SigLIP tower, a pooling projector, a causal LM.

The SigLIP tower turns an ``S x S`` image into a ``g x g`` grid of patch tokens (``g = S / P``,
no CLS token); the projector averages ``q x q`` blocks of them (``AvgPool2d``, ``q = g / s``,
``s^2`` = ``mm_tokens_per_image``), normalizes (RMSNorm) and projects each pooled cell. Decoder
image token ``k`` of an image is therefore the mean of the patches of cell
``(\lfloor k / s \rfloor, k \bmod s)``, pixels ``[r q P, (r+1) q P) x [c q P, (c+1) q P)``:

.. math:: E_{k, v} = \frac{1}{q^2}\,[\text{patch } v \text{ lies in cell } k].

In the decoder, ``token_type_ids`` (1 at image tokens) make each image's token block attend to
itself in both directions (``Gemma3Model``'s mask); without them the model runs plainly causal,
another model. :meth:`Gemma3Adapter.call_model` therefore builds them from ``input_ids`` when
they are not given (what Gemma's processor returns), and refuses given ones that disagree. The
block lies wholly in the prompt, so no position before a generated token reads a later one:
each generated token's explanation is still that of its prefix.

Refused: pixel inputs other than (images, C, S, S) at the tower's ``image_size``, and placeholder
counts that do not fill ``mm_tokens_per_image`` tokens per image (pan-and-scan crops are
separate images to Gemma and are mapped each on its own crop).

Example::

    >>> adapter = get_adapter(gemma3)                                   # a Gemma3Adapter
    >>> adapter.images(gemma3, input_ids, {"pixel_values": pixels})[0].token_map.shape   # (4, 16)
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Sequence

import torch
from torch import nn

from ...errors import InputError
from .base import IMAGE_STREAM, TEXT_STREAM, ImageTokens, VisionLanguageAdapter, placeholders_per_image


def _gemma(model: nn.Module) -> nn.Module:
    """The ``Gemma3Model`` inside ``model`` (the module holding the tower and the projector)."""
    for module in model.modules():
        if hasattr(module, "vision_tower") and hasattr(module, "multi_modal_projector"):
            return module
    raise InputError(f"{type(model).__name__} holds no Gemma 3 model (a module with vision_tower and "
                     "multi_modal_projector).")


def pooling_map(grid: int, side: int) -> torch.Tensor:
    """(side^2, grid^2): row ``k`` averages the patches (row-major) of pooled cell ``divmod(k, side)``."""
    if grid % side:
        raise InputError(f"A {grid}x{grid} patch grid cannot be average-pooled to {side}x{side} tokens; "
                         "mm_tokens_per_image must be a square whose side divides image_size / patch_size.")
    block = grid // side
    cell = torch.arange(grid) // block
    owner = (cell[:, None] * side + cell[None, :]).reshape(-1)  # pooled cell of each patch
    token_map = torch.zeros(side * side, grid * grid, dtype=torch.float64)
    token_map[owner, torch.arange(grid * grid)] = 1.0 / block ** 2
    return token_map


class Gemma3Adapter(VisionLanguageAdapter):
    """``Gemma3ForConditionalGeneration`` (see the module docstring)."""

    name = "gemma3-vl"
    families = "Gemma 3 vision-language (Gemma3ForConditionalGeneration: SigLIP tower, pooling projector, causal LM)"
    stream_components: Mapping[str, str] = {"vision_tower": IMAGE_STREAM, "language_model": TEXT_STREAM}

    def vision_tower(self, model: nn.Module) -> nn.Module:
        return _gemma(model).vision_tower

    def projector(self, model: nn.Module) -> nn.Module:
        return _gemma(model).multi_modal_projector

    def image_token_id(self, model: nn.Module) -> int:
        return int(_gemma(model).config.image_token_id)

    def feeding_calls(self, model: nn.Module) -> int:
        """The projector reads the tower's last hidden state: after all its layers."""
        return int(_gemma(model).config.vision_config.num_hidden_layers)

    def images(self, model: nn.Module, input_ids: torch.Tensor, image_inputs: Mapping[str, Any]) -> List[ImageTokens]:
        config = _gemma(model).config
        pixels = image_inputs.get("pixel_values")
        size, patch = int(config.vision_config.image_size), int(config.vision_config.patch_size)
        if not isinstance(pixels, torch.Tensor) or pixels.dim() != 4 or not pixels.is_floating_point() \
                or tuple(pixels.shape[-2:]) != (size, size):
            raise InputError(f"Gemma 3's images are pixel_values (images, C, {size}, {size}) in floating point (the "
                             f"tower's image_size); got {type(pixels).__name__} "
                             f"{tuple(getattr(pixels, 'shape', ()))}. Use the model's processor.")
        per_image = int(config.mm_tokens_per_image)
        side = int(round(per_image ** 0.5))
        if side * side != per_image:
            raise InputError(f"mm_tokens_per_image={per_image} is not a square; Gemma 3 pools the patch grid to a "
                             "square of tokens.")
        grid = size // patch
        token_map = pooling_map(grid, side)
        found = self.image_token_positions(model, input_ids)
        if len(found) != per_image * pixels.shape[0]:
            raise InputError(f"input_ids hold {len(found)} image tokens (id {config.image_token_id}) but "
                             f"{pixels.shape[0]} image(s) give {per_image} tokens each; expand each image's "
                             "placeholder to mm_tokens_per_image tokens (as Gemma3Processor does).")
        images = [ImageTokens(example, positions, i, (0, grid * grid), token_map, (grid, grid),
                              torch.arange(grid * grid), (size, size))
                  for i, (example, positions) in enumerate(placeholders_per_image(found, [per_image] * len(pixels)))]
        return images

    def pixel_relevance(self, model: nn.Module, products: Mapping[str, torch.Tensor],
                        images: Sequence[ImageTokens]) -> List[torch.Tensor]:
        summed = products["pixel_values"].sum(1)  # (images, S, S)
        return [summed[image.vision_row] for image in images]

    def token_type_inputs(self, model: nn.Module, input_ids: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The per-token keywords the processor returns next to ``input_ids`` (what ``generate``
        needs too): ``token_type_ids``, 1 at image tokens, which make the image blocks bidirectional."""
        return {"token_type_ids": (input_ids == self.image_token_id(model)).to(torch.long)}

    def generation_inputs(self, model: nn.Module, input_ids: torch.Tensor,
                          image_inputs: Mapping[str, Any]) -> Dict[str, Any]:
        """The image keywords for ``model.generate(input_ids, ...)``: the images and ``token_type_ids``."""
        return {**image_inputs, **self.token_type_inputs(model, input_ids)}

    def call_model(self, model, inputs, additional_forward_args, forward_kwargs):
        """With ``token_type_ids`` (1 at image tokens, built from ``input_ids`` when not given):
        the bidirectional image blocks of Gemma 3's mask, as its processor's inputs give them."""
        kwargs = dict(forward_kwargs or {})
        ids = inputs[0] if inputs and not inputs[0].is_floating_point() else kwargs.get("input_ids")
        if isinstance(ids, torch.Tensor) and kwargs.get("pixel_values") is not None:
            expected = self.token_type_inputs(model, ids)["token_type_ids"]
            given = kwargs.get("token_type_ids")
            if given is None:
                kwargs["token_type_ids"] = expected
            elif not torch.equal(given.to(expected.device).to(torch.long), expected):
                raise InputError("token_type_ids must be 1 exactly at the image tokens of input_ids (Gemma 3 attends "
                                 "bidirectionally within those blocks); the given ones differ. Pass the processor's "
                                 "token_type_ids, or leave them out to have them built from input_ids.")
        return super().call_model(model, inputs, additional_forward_args, kwargs)
