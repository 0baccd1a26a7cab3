"""The images of a vision-language generation explanation: inputs in, per-token image maps out.

In: the model's processor output as the prompt (its ``pixel_values`` are read from it),
``images=`` (one image (C, H, W), a stack (n, C, H, W), or for a batch a list with one
such entry per prompt, concatenated in prompt order) or the model's own image keywords
(``pixel_values=...``, as its processor returns them for the whole batch). The prompts' ids
already hold each image's expanded placeholder tokens (as the model's processor writes them).

Out, per prompt: ``image_attr`` (T, H, W) per image in the image's pixel layout (a list when
the prompt has several images) and ``image_token_attr`` (T, V) over the vision tower's tokens
(CLS first, then the patch grid); ``image_grid`` (rows, cols) per image.

Example::

    >>> inputs = gathered_image_inputs(adapter, pixels, {}, count=1, batched=False)   # {"pixel_values": ...}
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..adapters.vision_language import ImageTokens, VisionLanguageAdapter, to_pixels
from ..errors import InputError
from .vision_steps import image_key


def vision_language_adapter(method: Any) -> Optional[VisionLanguageAdapter]:
    """The method's adapter when it is a vision-language one, else None."""
    adapter = getattr(method, "adapter", None)
    return adapter if isinstance(adapter, VisionLanguageAdapter) else None


def _stacked(image: Any, where: str) -> torch.Tensor:
    if not isinstance(image, torch.Tensor) or not image.is_floating_point() or image.dim() not in (3, 4):
        raise InputError(f"{where} must be a floating-point image tensor (C, H, W) or a stack (n, C, H, W); got "
                         f"{type(image).__name__} {tuple(getattr(image, 'shape', ()))}.")
    return image[None] if image.dim() == 3 else image


def gathered_image_inputs(adapter: Optional[VisionLanguageAdapter], images: Any, keywords: Mapping[str, Any],
                          count: int, batched: bool) -> Optional[Dict[str, Any]]:
    """The model's image keywords for the batch, or None when no image is given."""
    if images is None and not keywords:
        return None
    if adapter is None:
        raise InputError("images were given, but the wrapped method's adapter is not a vision-language one (LLaVA, "
                         "...); explain a vision-language model, or leave images out.")
    unknown = sorted(set(keywords) - set(adapter.image_input_names))
    if unknown:
        raise InputError(f"attribute() got the keywords {unknown}; the {adapter.name} adapter takes the images as "
                         f"images= or as {list(adapter.image_input_names)}.")
    if images is not None and keywords:
        raise InputError(f"The images were given twice: as images= and as {sorted(keywords)}; pass one of them.")
    if images is None:
        return dict(keywords)
    if batched:
        if not isinstance(images, (list, tuple)) or len(images) != count:
            raise InputError(f"For a batch of {count} prompts, images must be a list with one entry per prompt (an "
                             f"image (C, H, W) or a stack (n, C, H, W)); got {type(images).__name__}.")
        stacked = torch.cat([_stacked(image, f"images[{i}]") for i, image in enumerate(images)])
    else:
        stacked = _stacked(images, "images")
    return {adapter.image_input_names[0]: stacked}


def processor_images(inp: Any, adapter: Optional[VisionLanguageAdapter], keywords: Dict[str, Any]) -> Dict[str, Any]:
    """A processor's output (``input_ids``, ``attention_mask``, ``pixel_values``...) given as
    the prompt: its image entries join ``keywords`` (the ids are read as a tokenizer's batch)."""
    if adapter is None or not (hasattr(inp, "keys") and "input_ids" in inp):
        return keywords
    found = {name: inp[name] for name in adapter.image_input_names if name in inp and inp[name] is not None}
    clash = sorted(set(found) & set(keywords))
    if clash:
        raise InputError(f"The images were given twice: in the processor's output and as the keywords {clash}.")
    return {**found, **keywords}


def moved(inputs: Dict[str, Any], device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    """The image inputs on the model's device, floating ones in its dtype (the tower casts them
    anyway; the pixels' relevance is then read in the model's precision)."""
    return {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device)) if isinstance(v, torch.Tensor) else v
            for k, v in inputs.items()}


def image_columns(per_stream: Mapping[str, torch.Tensor], images: Sequence[ImageTokens], example: int,
                  rows: List[int]) -> Tuple[Any, Any, Any]:
    """Example ``example``'s (image_attr, image_token_attr, image_grid): each a tensor for one
    image, a list for several, None for none. ``rows``: the example's explained groups."""
    owned = [i for i, image in enumerate(images) if image.example == example]
    pixel_maps, token_maps, grids = [], [], []
    for index in owned:
        tokens = per_stream[image_key(index)][rows]
        pixels = per_stream.get(f"pixels:{index}")
        pixel_maps.append((pixels[rows] if pixels is not None else to_pixels(tokens, images[index])).cpu())
        token_maps.append(tokens.cpu())
        grids.append(images[index].grid)
    if not owned:
        return None, None, None
    if len(owned) == 1:
        return pixel_maps[0], token_maps[0], grids[0]
    return pixel_maps, token_maps, grids
