"""The images of a vision-language generation explanation: inputs in, per-token image maps out.

In: the model's processor output as the prompt (its ``pixel_values`` are read from it),
``images=`` (one image (C, H, W), a stack (n, C, H, W), or for a batch a list with one
such entry per prompt, concatenated in prompt order; None or an empty (0, C, H, W) stack for a
prompt without images) or the model's own image keywords (``pixel_values=...``, as its
processor returns them for the whole batch). The prompts' ids already hold each image's
expanded placeholder tokens (as the model's processor writes them). Refused rather than
dropped: placeholders without images, images given twice, image inputs a method or adapter
does not map back to the image (:data:`IMAGE_KEYS`), misspelled keywords, and images holding
NaN or +/-inf (named before any forward, as the classifier path names its inputs).

Out, per prompt: ``image_attr`` (T, H, W) per image in the image's pixel layout (a list when
the prompt has several images) and ``image_token_attr`` (T, V) over the vision tower's tokens
(CLS first when the tower has one, then the patch grid); ``image_grid`` (rows, cols) per image.

Example::

    >>> inputs = gathered_image_inputs(adapter, pixels, {}, count=1, batched=False)   # {"pixel_values": ...}
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..adapters.input_checks import refuse_non_finite
from ..adapters.vision_language.base import ImageTokens, VisionLanguageAdapter, to_pixels
from ..errors import InputError
from .vision_steps import image_key


#: Processor-output / forward keywords that carry images (or their layout) in HF vision-language
#: models: a method that explains no images must not drop them silently.
IMAGE_KEYS = ("pixel_values", "image_sizes", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
              "pixel_attention_mask", "image_attention_mask", "aspect_ratio_ids", "aspect_ratio_mask")


def vision_language_adapter(method: Any) -> Optional[VisionLanguageAdapter]:
    """The method's adapter when it is a vision-language one, else None."""
    adapter = getattr(method, "adapter", None)
    return adapter if isinstance(adapter, VisionLanguageAdapter) else None


def _supported() -> str:
    from ..adapters.registry import registered_adapters

    return "; ".join(a.families for a in registered_adapters() if isinstance(a, VisionLanguageAdapter))


def _no_images_here(method: Any, given: str) -> InputError:
    return InputError(f"{given}, but the wrapped method {type(method).__name__} explains no images (its "
                      f"adapter is not a vision-language one), so they would be dropped. Images are explained for "
                      f"{_supported()}, with the package's methods (AttnLRP, ConservativeLRP, GenericAttention, ...); "
                      "or leave the images out for a text-only explanation.")


def _stacked(image: Any, where: str) -> torch.Tensor:
    if not isinstance(image, torch.Tensor) or not image.is_floating_point() or image.dim() not in (3, 4):
        raise InputError(f"{where} must be a floating-point image tensor (C, H, W) or a stack (n, C, H, W); got "
                         f"{type(image).__name__} {tuple(getattr(image, 'shape', ()))}.")
    return image[None] if image.dim() == 3 else image


def gathered_image_inputs(adapter: Optional[VisionLanguageAdapter], images: Any, keywords: Mapping[str, Any],
                          count: int, batched: bool, method: Any = None) -> Optional[Dict[str, Any]]:
    """The model's image keywords for the batch, or None when no image is given. A batch's
    entry None (or an empty (0, C, H, W) stack) gives that prompt no image."""
    keywords = {name: value for name, value in keywords.items() if value is not None}
    if images is None and not keywords:
        return None
    names = set(adapter.image_input_names) if adapter is not None else set()
    unknown = sorted(set(keywords) - set(IMAGE_KEYS) - names)
    if unknown:
        takes = f"and the {adapter.name} adapter's image inputs {list(adapter.image_input_names)}" \
            if adapter is not None else "(no image inputs: the wrapped method's adapter is not a vision-language one)"
        raise InputError(f"attribute() got unexpected keyword arguments {unknown}; it takes inp, target, gen_args, "
                         f"contrast, span, skip_tokens, score, images {takes}. Check the spelling.")
    unmapped = sorted(set(keywords) - names)
    if adapter is not None and unmapped:
        raise InputError(f"attribute() got the image inputs {unmapped}, which the {adapter.name} adapter does not "
                         f"map back to the image; it takes the images as images= or as "
                         f"{list(adapter.image_input_names)}.")
    if adapter is None:
        raise _no_images_here(method, "images= was given" if images is not None else f"the image inputs "
                              f"{sorted(keywords)} were given")
    if images is not None and keywords:
        raise InputError(f"The images were given twice: as images= and as {sorted(keywords)} (keywords, or the "
                         "processor's output given as inp); pass one of them.")
    if images is None:
        _refuse_non_finite_keywords(keywords)
        return dict(keywords)
    if batched:
        if not isinstance(images, (list, tuple)) or len(images) != count:
            raise InputError(f"For a batch of {count} prompts, images must be a list with one entry per prompt (an "
                             f"image (C, H, W), a stack (n, C, H, W), or None for a prompt without images); got "
                             f"{type(images).__name__}.")
        given = [_stacked(image, f"images[{i}]") for i, image in enumerate(images) if image is not None]
        refuse_non_finite(given, [f"the images of prompt {i} (images[{i}])" for i, image in enumerate(images)
                                  if image is not None])
        if not given:
            return None
        stacked = torch.cat(given)
    else:
        stacked = _stacked(images, "images")
        refuse_non_finite([stacked], ["the images given as images="])
    return {adapter.image_input_names[0]: stacked}


def _refuse_non_finite_keywords(keywords: Mapping[str, Any]) -> None:
    """Image keywords (``pixel_values=``, a processor output's) holding NaN or +/-inf are refused
    before any forward, naming the keyword, as the classifier path names its inputs: the forward
    would carry them into the scores, where they surfaced as an overflow of the relevance."""
    named = [(name, value) for name, value in keywords.items() if isinstance(value, torch.Tensor)]
    refuse_non_finite([value for _, value in named], [f"the image input {name}" for name, _ in named])


def processor_images(inp: Any, adapter: Optional[VisionLanguageAdapter], keywords: Dict[str, Any],
                     method: Any = None) -> Dict[str, Any]:
    """A processor's output (``input_ids``, ``attention_mask``, ``pixel_values``...) given as
    the prompt: its image entries join ``keywords`` (the ids are read as a tokenizer's batch).
    Refused: image entries the adapter does not read (a method that explains no images, or a
    key such as ``pixel_values_videos`` the family's adapter does not map)."""
    if not (hasattr(inp, "keys") and "input_ids" in inp):
        return keywords
    present = {name for name in inp.keys() if inp[name] is not None}
    image_keys = sorted(present & set(IMAGE_KEYS))
    if adapter is None:
        if image_keys:
            raise _no_images_here(method, f"The processor's output holds images ({image_keys})")
        return keywords
    ignored = sorted(set(image_keys) - set(adapter.image_input_names))
    if ignored:
        raise InputError(f"The processor's output holds {ignored}, which the {adapter.name} adapter does not map "
                         f"back to the image (it reads {list(adapter.image_input_names)}); remove them, or give "
                         "the images as images=.")
    found = {name: inp[name] for name in adapter.image_input_names if name in present}
    clash = sorted(set(found) & set(keywords))
    if clash:
        raise InputError(f"The images were given twice: in the processor's output and as the keywords {clash}.")
    return {**found, **keywords}


def placeholder_check(model: Any, adapter: Optional[VisionLanguageAdapter], ids: Sequence[Sequence[int]],
                      image_inputs: Optional[Mapping[str, Any]]) -> None:
    """Refuse prompts that hold image placeholder tokens when no image is given: the model would
    read the placeholders' own embeddings as text, and the explanation would hide them."""
    if image_inputs is not None:
        return
    if adapter is not None:
        token = adapter.image_token_id(model)
    else:  # a vision-language model explained by a text-only method (Captum's rows)
        config = getattr(model, "config", None)
        token = getattr(config, "image_token_id", getattr(config, "image_token_index", None)) \
            if getattr(config, "vision_config", None) is not None else None
    if token is None:
        return
    count = sum(int(i) == int(token) for row in ids for i in row)
    if count and adapter is None:
        raise InputError(f"The prompt(s) hold {count} image placeholder tokens (id {token}), but the wrapped method "
                         "explains no images (its adapter is not a vision-language one); remove the placeholders "
                         "for a text-only explanation, or explain the image with the package's methods.")
    if count:
        raise InputError(f"The prompt(s) hold {count} image placeholder tokens (id {token}) but no images were given; "
                         "pass images=/pixel_values= (or the processor's output as inp), or remove the placeholders "
                         "for a text-only explanation.")


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
