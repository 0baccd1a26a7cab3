r"""Vision-language decoders: image tokens in a causal decoder's sequence, fed by a vision tower.

A vision-language model (LLaVA, Qwen2-VL, Gemma 3) runs a vision tower over each image (its
own, non-causal self-attention: the ``"image"`` stream), maps the tower's tokens through a
projector (or a patch merger) to embeddings, and writes them over placeholder tokens of the
decoder's sequence (the causal ``"tokens"`` stream). No attention call joins the two streams:
decoder image token ``k`` *is* the projection of a few vision tokens. Relevance on the image
tokens is carried into the tower through that map ``E`` (K, V),

.. math:: R^{d,\text{img}} = R^{dd}\, E\, R^{vv},

(the ICCV'21 initialisation ``R^{dv} = E R^{vv}`` for a decoder sequence whose image tokens
come from the tower, then Eq. 6 in the decoder; Chefer, Gur & Wolf, ICCV 2021), and from the
tower's patch tokens to the image's pixels.

**How a family plugs in.** Subclass :class:`VisionLanguageAdapter` (itself a
:class:`~captum_transformers.adapters.huggingface.adapter.HuggingFaceAdapter`) and give:

* :attr:`stream_components`: ``{path component of the vision tower's modules: "image",
  path component of the decoder's: "tokens"}`` (LLaVA: ``vision_tower`` / ``language_model``);
* :meth:`vision_tower`, :meth:`projector`: the modules (for rules and reading relevance);
* :meth:`image_token_id`: the placeholder id in ``input_ids``;
* :meth:`feeding_calls`: how many of the tower's attention calls (per image row, in call
  order) come before the hidden state the projector reads (LLaVA's ``vision_feature_layer``);
* :meth:`images`: one :class:`ImageTokens` per image of the batch: its decoder positions,
  where it sits in the tower's calls, the map ``E`` (``token_map``), its patch grid and the
  order of the grid's cells among the tower's tokens;
* :meth:`pixel_relevance`: per image, the (H, W) map of ``x * dy/dx`` summed over channels,
  from the gradient of the pixel input(s) (LLaVA: (images, C, H, W) pixel values; Qwen2-VL:
  flattened patches);
* optionally :meth:`check_image_inputs`: refuse image inputs the family does not map back
  (LLaVA: ``image_sizes``), before a target is generated with them;
* optionally :meth:`generation_inputs`: the keywords ``generate`` needs next to the ids when
  no target is given (default: the image inputs as given).

The rest (streams and layouts, placeholder positions, carrying scores onto the grid and the
pixels) is shared here. Register the adapter for the family's model class.

Example::

    >>> adapter = get_adapter(llava)                            # a LlavaAdapter
    >>> images = adapter.images(llava, input_ids, {"pixel_values": pixels})
    >>> vision = image_token_scores(decoder_scores, images[0])   # (V,) over the tower's tokens
    >>> heat = to_pixels(vision, images[0])                      # (H, W)
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Dict, List, Mapping, Sequence, Tuple

import torch
from torch import nn

from ...capture.recorder import Recorder
from ...capture.trace import InputSpan, StreamLayouts, TokenLayout
from ...errors import CaptureError, InputError
from ..huggingface.adapter import HuggingFaceAdapter
from ..query_rows import chosen_rows
from ..relevance_reading import RelevanceResult

#: The decoder's stream and the vision tower's.
TEXT_STREAM, IMAGE_STREAM = "tokens", "image"


@dataclasses.dataclass(frozen=True)
class ImageTokens:
    """Where one image of a batch sits, in the decoder and in the vision tower.

    ``example``: its row of the decoder batch; ``positions`` (K,): the decoder positions of its
    placeholder tokens, in the order the projector's features fill them; ``vision_row``: the
    row (batch index) of the tower's attention calls that holds it and ``vision_span``
    ``(start, stop)`` its tokens there (V = stop - start); ``token_map`` (K, V): decoder image
    token ``k`` made from vision token ``v`` (LLaVA: one-hot, after the dropped CLS; a 2x2
    merger: four entries); ``grid`` (rows, cols) of patches, ``grid_tokens`` (rows * cols,):
    the vision-token index (within the span) of each grid cell, row-major; ``pixel_size``
    (H, W) of the image as given.
    """

    example: int
    positions: torch.Tensor
    vision_row: int
    vision_span: Tuple[int, int]
    token_map: torch.Tensor
    grid: Tuple[int, int]
    grid_tokens: torch.Tensor
    pixel_size: Tuple[int, int]

    @property
    def num_vision_tokens(self) -> int:
        return self.vision_span[1] - self.vision_span[0]


@dataclasses.dataclass(frozen=True)
class TowerLayout(TokenLayout):
    """The vision tower's stream: its tokens get no scores of their own from a direct call (no
    attention call joins them to the explained decoder row; relevance reaches them only through
    the image tokens' map ``E``, which :class:`GenerationAttribution` applies), so returning
    them (``return_tokens=True``) is refused rather than given as zeros."""

    model_name: str = ""

    def returned(self, scores: torch.Tensor) -> torch.Tensor:
        raise InputError(
            f"return_tokens=True on {self.model_name or 'a vision-language model'} would return the vision tower's "
            "tokens, which a direct call does not score (the image reaches the decoder through its image tokens). "
            "For maps over the image, use GenerationAttribution(method, tokenizer).attribute(input_ids, target=..., "
            "images=pixel_values) (its image_attr); for the decoder's token scores (B, N) over input_ids, image "
            "tokens included, call without return_tokens.")


class VisionLanguageAdapter(HuggingFaceAdapter):
    """A vision tower feeding a causal decoder's image tokens (see the module docstring).

    Streams: ``"image"`` (the tower, one row per image in its calls) and ``"tokens"`` (the
    decoder, read at its last real token); only ``"tokens"`` is explained.
    """

    name = "vision-language"
    #: The forward keywords that carry the images (passed with ``images=`` / as keywords).
    image_input_names: Tuple[str, ...] = ("pixel_values",)
    layout_builders: Mapping[frozenset, str] = {frozenset({IMAGE_STREAM, TEXT_STREAM}): "vision_language_layouts"}

    def __init__(self) -> None:
        super().__init__()

    # -- what a family gives ----------------------------------------------------------
    @abc.abstractmethod
    def vision_tower(self, model: nn.Module) -> nn.Module:
        """The module that turns pixels into vision tokens."""

    @abc.abstractmethod
    def projector(self, model: nn.Module) -> nn.Module:
        """The module that turns vision tokens into decoder embeddings."""

    @abc.abstractmethod
    def image_token_id(self, model: nn.Module) -> int:
        """The placeholder id of image tokens in ``input_ids``."""

    @abc.abstractmethod
    def feeding_calls(self, model: nn.Module) -> int:
        """How many of the tower's attention calls come before the hidden state the projector reads."""

    @abc.abstractmethod
    def images(self, model: nn.Module, input_ids: torch.Tensor, image_inputs: Mapping[str, Any]) -> List[ImageTokens]:
        """One :class:`ImageTokens` per image of the batch, in the order the model reads them."""

    @abc.abstractmethod
    def pixel_relevance(self, model: nn.Module, products: Mapping[str, torch.Tensor],
                        images: Sequence[ImageTokens]) -> List[torch.Tensor]:
        """Per image, (H, W): ``products[name]`` (``x * dy/dx`` of each image input) summed over channels."""

    def check_image_inputs(self, model: nn.Module, image_inputs: Mapping[str, Any]) -> None:
        """Refuse image inputs the family cannot map back before anything runs (no-op by default)."""

    def generation_inputs(self, model: nn.Module, input_ids: torch.Tensor,
                          image_inputs: Mapping[str, Any]) -> Dict[str, Any]:
        """The keywords ``model.generate(input_ids=..., attention_mask=..., **these)`` needs next to
        the ids: the image inputs as given by default; a family adds the per-token keywords its
        processor returns (Qwen2-VL's ``mm_token_type_ids``, Gemma 3's ``token_type_ids``)."""
        return dict(image_inputs)

    # -- shared ---------------------------------------------------------------------
    def finish_relevance(self, model: nn.Module, result: RelevanceResult) -> RelevanceResult:
        """The tower's stream, read at its first layer but unscored there (zeros), gets a
        :class:`TowerLayout` so ``return_tokens=True`` refuses it (a tower whose calls were not
        recorded, as Qwen2-VL's per-image calls, has no layout of its own)."""
        streams = result.streams
        if result.stream_tokens and IMAGE_STREAM in result.stream_tokens and streams is not None \
                and not isinstance(streams.layouts.get(IMAGE_STREAM), TowerLayout):
            tokens = result.stream_tokens[IMAGE_STREAM]
            tower = TowerLayout(tokens.shape[-1], torch.zeros(tokens.shape[0], 1, dtype=torch.long,
                                                              device=tokens.device), model_name=type(model).__name__)
            streams = StreamLayouts({**streams.layouts, IMAGE_STREAM: tower}, streams.explained, streams.inputs)
            result = dataclasses.replace(result, streams=streams)
        return result

    def image_token_positions(self, model: nn.Module, input_ids: torch.Tensor) -> List[Tuple[int, int]]:
        """Every (example, position) of a placeholder token, row-major: the order in which the
        model writes the projected features over them (``masked_scatter``)."""
        if input_ids.is_floating_point() or input_ids.dim() != 2:
            raise InputError(f"A vision-language model is explained from input_ids (B, N) holding the image "
                             f"placeholder tokens; got shape {tuple(input_ids.shape)} dtype {input_ids.dtype}.")
        found = (input_ids == self.image_token_id(model)).nonzero().tolist()
        return [(int(b), int(p)) for b, p in found]

    def vision_language_layouts(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...],
                                recorder: Recorder) -> StreamLayouts:
        """``"tokens"``: the decoder, read at its last real token (causal); ``"image"``: the
        tower's rows (one per image, or one flat row), never read directly (its scores come
        through the image tokens; ``return_tokens=True`` is refused, see :class:`TowerLayout`).
        Input 0 (ids) maps onto the decoder; the others onto nothing."""
        decoder_sites = [s for s in recorder.sites if s.streams[0] == TEXT_STREAM]
        vision_sites = [s for s in recorder.sites if s.streams[0] == IMAGE_STREAM]
        if not decoder_sites or not all(s.causal for s in decoder_sites):
            raise CaptureError(f"The decoder of {type(model).__name__} made no causal self-attention call; a "
                               "vision-language model is explained as a causal decoder fed by a vision tower.")
        batch, device = decoder_sites[0].batch_size, inputs[0].device
        num_text = recorder.stream_length(TEXT_STREAM)
        mask = recorder.stream_mask(TEXT_STREAM)
        text = TokenLayout(num_text, chosen_rows("last", num_text, mask, batch, device), mask)
        vision_rows = vision_sites[0].batch_size
        image = TowerLayout(recorder.stream_length(IMAGE_STREAM),
                            torch.zeros(vision_rows, 1, dtype=torch.long, device=device),
                            model_name=type(model).__name__)
        spans = (InputSpan(TEXT_STREAM),) + (None,) * (len(inputs) - 1)
        return StreamLayouts({TEXT_STREAM: text, IMAGE_STREAM: image}, (TEXT_STREAM,), spans)


def image_token_scores(decoder_scores: torch.Tensor, image: ImageTokens) -> torch.Tensor:
    """(V,) scores over the image's vision tokens: its decoder image tokens' scores (a row of
    ``decoder_scores`` (B, N)) through ``token_map``."""
    row = decoder_scores[image.example, image.positions.to(decoder_scores.device)]
    return row @ image.token_map.to(device=row.device, dtype=row.dtype)


def grid_scores(vision_scores: torch.Tensor, image: ImageTokens) -> torch.Tensor:
    """(..., rows, cols): scores over the vision tokens (..., V) on the image's patch grid."""
    cells = vision_scores[..., image.grid_tokens.to(vision_scores.device)]
    return cells.reshape(*vision_scores.shape[:-1], *image.grid)


def to_pixels(vision_scores: torch.Tensor, image: ImageTokens) -> torch.Tensor:
    """(..., H, W): scores over the vision tokens (..., V) on the patch grid, upsampled
    bilinearly to the image's pixels (as the package maps ViT patch scores onto images)."""
    grid = grid_scores(vision_scores, image)
    lead = grid.shape[:-2]
    flat = grid.reshape(-1, 1, *image.grid)
    up = torch.nn.functional.interpolate(flat, size=image.pixel_size, mode="bilinear", align_corners=False)
    return up.reshape(*lead, *image.pixel_size)


def split_by_example(images: Sequence[ImageTokens], batch: int) -> Dict[int, List[int]]:
    """The indices of ``images`` per example of the batch (an example may have none)."""
    owned: Dict[int, List[int]] = {b: [] for b in range(batch)}
    for index, image in enumerate(images):
        owned[image.example].append(index)
    return owned


def placeholders_per_image(found: Sequence[Tuple[int, int]], counts: Sequence[int]) -> List[Tuple[int, torch.Tensor]]:
    """Split the row-major placeholder ``(example, position)`` pairs (:meth:`VisionLanguageAdapter.
    image_token_positions`) into one run per image, ``counts[i]`` tokens for image ``i``; returns
    ``(example, positions)`` per image. An image's run must sit in one example (the caller has checked
    that ``len(found) == sum(counts)``).

    Example::

        >>> placeholders_per_image([(0, 2), (0, 3), (1, 1), (1, 2)], [2, 2])
        [(0, tensor([2, 3])), (1, tensor([1, 2]))]
    """
    runs, start = [], 0
    for index, count in enumerate(counts):
        chunk = found[start:start + count]
        start += count
        examples = {b for b, _ in chunk}
        if len(examples) != 1:
            raise InputError(f"Image {index}'s {count} placeholder tokens are split over examples "
                             f"{sorted(examples)}; each image's tokens must sit in one prompt.")
        runs.append((chunk[0][0], torch.tensor([p for _, p in chunk], dtype=torch.long)))
    return runs
