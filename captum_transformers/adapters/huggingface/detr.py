"""DETR (``DetrForObjectDetection``): an encoder over the backbone's feature grid and a
decoder over the object queries, explained with the encoder-decoder rules of Chefer et al.

DETR's attention runs through ``ALL_ATTENTION_FUNCTIONS``, so the HuggingFace kernel
already observes it; this adapter only says which streams each call mixes and how the
streams map back onto the image:

* encoder self-attention mixes ``("encoder", "encoder")``, the (h, w) feature grid of the
  backbone, flattened row-major;
* decoder self-attention mixes ``("decoder", "decoder")``, the object queries;
* decoder cross-attention mixes ``("decoder", "encoder")``: queries read the grid.

A detection is the pair ``(query_index, class_index)`` of the logits (B, num_queries,
num_labels + 1), whose last class is "no object". Its explanation is row ``query_index``
of the decoder-to-encoder relevance ``R^{de}`` (Chefer et al., ICCV 2021, Sec. 3-4, Eq. 10-11),
upsampled from the feature grid to the image. Example::

    >>> maps = GenericAttention(detr).attribute(pixel_values, target=(query, label))  # (B, 3, H, W)
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ...errors import CaptureError, InputError
from ...capture.targets import select_targets
from ...capture.trace import Block, InputSpan, StreamLayouts, TokenLayout
from .kernel import block_kind
from .adapter import HuggingFaceAdapter, is_attention_module
from ...capture.recorder import Recorder

ENCODER = "encoder"
DECODER = "decoder"

# The Transformer halves of DETR-like models, by class name (a row per architecture).
_SIDES: Dict[str, str] = {"DetrEncoder": ENCODER, "DetrDecoder": DECODER}
# (side, block kind) -> (query stream, key stream).
_STREAMS: Dict[Tuple[str, str], Tuple[str, str]] = {
    (ENCODER, "self"): (ENCODER, ENCODER),
    (DECODER, "self"): (DECODER, DECODER),
    (DECODER, "cross"): (DECODER, ENCODER),
}
# Backbone output strides tried when matching the encoder length to the image (a ResNet's
# last stage is 32, a DC5 one 16, tiny test backbones less).
_STRIDES = tuple(2 ** k for k in range(8))


def feature_grid(height: int, width: int, num_tokens: int) -> Tuple[int, int]:
    """The (h, w) feature grid a strided backbone makes of an ``height`` x ``width`` image
    and that the encoder flattened to ``num_tokens`` tokens.

    Strided convolutions and poolings with "same" padding give ``ceil(H / s)`` (unpadded
    ones ``floor(H / s)``), so the grid is the one of the power-of-two stride ``s`` with
    ``h * w == num_tokens``. Example: ``feature_grid(64, 48, 48) == (8, 6)`` (stride 8).
    """
    for stride in _STRIDES:
        for rounding in (math.ceil, math.floor):
            grid = (rounding(height / stride), rounding(width / stride))
            if grid[0] * grid[1] == num_tokens:
                return grid
    raise CaptureError(
        f"The DETR encoder attended over {num_tokens} tokens, but no backbone stride in {list(_STRIDES)} turns the "
        f"{height}x{width} input into a grid of that many cells. Pass pixel_values (B, C, H, W) as the first input "
        "(not inputs_embeds), or explain a model whose backbone downsamples by a power of two."
    )


class DetrAdapter(HuggingFaceAdapter):
    """Adapter for HuggingFace DETR object detectors (``DetrForObjectDetection``).

    Streams: ``"encoder"`` (the backbone's feature grid, (h, w) from the input size and the
    encoder length; padding from ``pixel_mask``) and ``"decoder"`` (the object queries).
    The output reads the decoder: a target ``(query_index, class_index)`` (a tuple, a
    per-example list of tuples, or a (B, 2) tensor) explains that query's logit for that
    class, with the query's row of the decoder stream. ``target=None`` explains, per
    example, the most confident detection: the (query, class) with the highest softmax
    probability over the real classes ("no object", the last class, excluded).

    Inputs: ``pixel_values`` map onto the encoder grid (maps upsampled to the image);
    a ``pixel_mask`` passed as an input holds no tokens and gets zeros.
    """

    name = "detr"
    families = "HuggingFace DETR object detection (DetrForObjectDetection)"

    def __init__(self) -> None:
        super().__init__()  # no query_rows: the explained row is the target's object query

    def blocks(self, model: nn.Module) -> List[Block]:
        blocks = []
        for side_name, side in model.named_modules():
            stream_side = _SIDES.get(type(side).__name__)
            if stream_side is None:
                continue
            for name, module in side.named_modules(prefix=side_name):
                if not is_attention_module(module):
                    continue
                kind = block_kind(module)
                blocks.append(Block(name, module, kind, _STREAMS[(stream_side, kind)]))
        return blocks

    # -- streams ------------------------------------------------------------------------
    def stream_layouts(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...], recorder: Recorder) -> StreamLayouts:
        pixels = inputs[0]
        if pixels.dim() != 4 or not pixels.is_floating_point():
            raise InputError(
                f"DETR is explained from its pixel_values; got a first input of shape {tuple(pixels.shape)} and dtype "
                f"{pixels.dtype}. Pass pixel_values (B, C, H, W) as the first input (pixel_mask may follow)."
            )
        encoder_length = recorder.stream_length(ENCODER)
        num_queries = recorder.stream_length(DECODER)
        grid = feature_grid(pixels.shape[-2], pixels.shape[-1], encoder_length)
        batch = pixels.shape[0]
        # Rows of the encoder stream are not read by the output; the decoder's rows are set
        # from the target (rows_for_target), query 0 until then.
        rows = torch.zeros(batch, 1, dtype=torch.long, device=pixels.device)
        layouts = {
            ENCODER: TokenLayout(encoder_length, rows, _mask(recorder, ENCODER), 0, grid),
            DECODER: TokenLayout(num_queries, rows, _mask(recorder, DECODER)),
        }
        spans = (InputSpan(ENCODER, 0, None, grid),) + (None,) * (len(inputs) - 1)
        return StreamLayouts(layouts, (DECODER,), spans)

    # -- targets ------------------------------------------------------------------------
    def resolve_target(self, model: nn.Module, logits: torch.Tensor, target: Any):
        """``(query_index, class_index)`` targets; ``None``: per example, the most confident
        detection, ``argmax_{q, c < C} softmax(logits_q)_c`` ("no object" excluded)."""
        if logits.dim() != 3:
            raise CaptureError(
                f"DETR logits should be (B, num_queries, num_labels + 1), got shape {tuple(logits.shape)}."
            )
        if target is None:
            probs = logits.detach().softmax(dim=-1)[..., :-1]
            flat = probs.reshape(probs.shape[0], -1).argmax(dim=1)
            target = torch.stack(torch.unravel_index(flat, probs.shape[1:]), dim=1)
        try:
            return select_targets(logits, target)
        except InputError as error:
            raise InputError(
                f"{error} A DETR detection is the pair (query_index, class_index) into logits of shape "
                f"{tuple(logits.shape[1:])}: pass target=(q, c), a list of such pairs, or a (B, 2) tensor."
            ) from None

    def rows_for_target(self, model: nn.Module, streams: StreamLayouts, index: torch.Tensor) -> StreamLayouts:
        """The decoder stream's explained row is the target's query, ``index[:, 0]``."""
        decoder = streams.layouts[DECODER]
        rows = index[:, :1].to(device=decoder.query_rows.device, dtype=torch.long)
        layouts = dict(streams.layouts)
        layouts[DECODER] = TokenLayout(decoder.num_tokens, rows, decoder.token_mask)
        return StreamLayouts(layouts, streams.explained, streams.inputs)


def _mask(recorder: Recorder, stream: str) -> Optional[torch.Tensor]:
    """Non-padding tokens (B, N) of ``stream`` (from pixel_mask for the encoder), or None."""
    valid = recorder.stream_mask(stream)
    return None if valid is None or bool(valid.all()) else valid
