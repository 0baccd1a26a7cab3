r"""Generation steps of a vision-language model: the decoder's scores carried into the image.

A step's trace holds two streams: the vision tower's (non-causal, one row per image; it does
not depend on the generated tokens) and the decoder's (causal, the step's row moved to its
position). The wrapped method reduces the decoder's calls exactly as for a causal LM, giving
scores ``r`` over the decoder's tokens. The image tokens' part of ``r`` goes through the
image's ``token_map`` ``E`` onto the tower's output tokens, then:

* methods that chain every layer (GenericAttention, TransformerRelevance, AttentionRollout)
  go on through the tower's own calls before the feature layer: the tower's chain started
  from the row ``r_{img} E`` instead of a one-hot row. For GenericAttention this is the
  ICCV'21 bi-modal rule with ``R^{dv}`` initialised to ``E R^{vv}`` (the decoder's image
  tokens *are* the tower's outputs), so the image row is
  :math:`r^{img} = (e_q R^{dd})_{img}\, E\, R^{vv}`, the gradients in every ``Abar`` being
  those of the step's score; the rollout is the same product with ``rownorm(I + A)``;
* methods that read one map (RawAttention, AttentionGradCAM, PartialLRP, AttentionFlow) stop
  at the image tokens: their map is the decoder's last layer (or a flow over it), which has
  no continuation into the tower's layers, so ``r_{img} E`` is placed on the patch grid.

A per-stream ``start_layer`` (``{"image": 1}``) counts the tower's calls and the decoder's
separately. Scores over the tower's tokens are mapped onto the patch grid (the CLS token dropped) and
upsampled bilinearly to the image's pixels (:func:`~captum_transformers.adapters.vision_language.base.to_pixels`).

Example::

    >>> scores = vision_language_scores(GenericAttention(llava), trace, images, calls=2)
    >>> scores["tokens"].shape, scores["image:0"].shape       # (B, N), (V,)
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Dict, List, Mapping, Sequence

import torch

from ..adapters.vision_language.base import IMAGE_STREAM, TEXT_STREAM, ImageTokens, image_token_scores
from ..capture.trace import AttentionRecord, AttentionTrace, StreamLayouts, TokenLayout
from ..errors import CaptureError, InputError


def carries_into_tower(method: Any) -> bool:
    """Whether ``method`` chains every layer (its class's ``chains_every_layer``), so its rows go
    on through the vision tower."""
    return bool(getattr(type(method), "chains_every_layer", False))


def image_key(index: int) -> str:
    """The key of image ``index``'s scores among a step's per-stream scores."""
    return f"image:{index}"


def _sliced(value: Any, row: int, span: tuple) -> Any:
    if not isinstance(value, torch.Tensor) or value.dim() != 3:
        return value
    return value[row:row + 1, span[0]:span[1], span[0]:span[1]]


def _tower_trace(trace: AttentionTrace, image: ImageTokens, calls: int, start: torch.Tensor) -> AttentionTrace:
    """Image ``image``'s part of the tower's first ``calls`` calls, explained from the row ``start`` (V,)."""
    records = [r for r in trace.records if r.streams[0] == IMAGE_STREAM][:calls]
    if len(records) < calls:
        raise CaptureError(f"The vision tower made {len(records)} attention calls, fewer than the {calls} before its "
                           "feature layer; the adapter does not describe this model.")
    sliced = tuple(AttentionRecord(r.block, r.call_index, _sliced(r.forward_value, image.vision_row, image.vision_span),
                                   _sliced(r.backward_value, image.vision_row, image.vision_span), r.streams, r.group)
                   for r in records)
    tokens = image.num_vision_tokens
    rows = torch.arange(tokens, device=start.device)[None]
    layout = TokenLayout(tokens, rows, None, query_weights=start[None])
    renamed = tuple(dataclasses.replace(r, streams=("tokens", "tokens")) for r in sliced)
    return AttentionTrace(renamed, layout, trace.logits, trace.target, StreamLayouts.single(layout, 1))


def decoder_trace(trace: AttentionTrace) -> AttentionTrace:
    """The decoder's calls alone, as the trace of a causal LM."""
    layout = trace.streams.layouts[TEXT_STREAM]
    records = tuple(r for r in trace.records if r.streams[0] == TEXT_STREAM)
    return AttentionTrace(records, layout, trace.logits, trace.target, StreamLayouts.single(layout, 1))


def _for_stream(method: Any, stream: str) -> Any:
    """``method`` with its per-stream ``start_layer`` (``{"image": 1, "tokens": 0}``) read for
    ``stream`` alone: the decoder's and the tower's sub-traces each name their one stream "tokens"."""
    start = getattr(method, "start_layer", None)
    if not isinstance(start, Mapping):
        return method
    unknown = sorted(set(start) - {IMAGE_STREAM, TEXT_STREAM})
    if unknown:
        raise InputError(f"start_layer names the streams {unknown}; a vision-language model's are "
                         f"{[TEXT_STREAM, IMAGE_STREAM]} (the decoder and the vision tower).")
    chosen = copy.copy(method)
    chosen.start_layer = int(start.get(stream, 0))
    return chosen


def vision_language_scores(method: Any, trace: AttentionTrace, images: Sequence[ImageTokens],
                           calls: int) -> Dict[str, torch.Tensor]:
    """``{"tokens": (B, N), "image:i": (V_i,)}``: the decoder's scores and, per image, its
    scores over the tower's tokens (at the tower's input for methods that carry, else at the
    tower's output tokens the decoder's image tokens come from)."""
    if IMAGE_STREAM not in trace.streams.layouts:
        return method.stream_scores(trace)
    decoder = _for_stream(method, TEXT_STREAM).stream_scores(decoder_trace(trace))[TEXT_STREAM]
    scores: Dict[str, torch.Tensor] = {TEXT_STREAM: decoder}
    tower = _for_stream(method, IMAGE_STREAM) if carries_into_tower(method) else None
    for index, image in enumerate(images):
        start = image_token_scores(decoder, image)
        if tower is not None:
            start = tower.reduce(_tower_trace(trace, image, calls, start))[0]
        scores[image_key(index)] = start
    return scores


def relevance_image_scores(relevance: Dict[str, torch.Tensor], pixel_maps: List[torch.Tensor],
                           images: Sequence[ImageTokens]) -> Dict[str, torch.Tensor]:
    """A relevance step's ``{"tokens": (B, N), "image": (rows, V)}`` with, per image, its
    tower-input tokens' relevance ``"image:i"`` (V,) and its pixels' ``"pixels:i"`` (H, W)."""
    out = {TEXT_STREAM: relevance[TEXT_STREAM]}
    tower = relevance.get(IMAGE_STREAM)
    for index, image in enumerate(images):
        if tower is None:
            raise CaptureError("No relevance reached the vision tower's first layer; the image tokens of the prompt do "
                               "not come from the given images.")
        out[image_key(index)] = tower[image.vision_row, image.vision_span[0]:image.vision_span[1]]
        out[f"pixels:{index}"] = pixel_maps[index]
    return out
