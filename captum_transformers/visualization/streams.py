"""Views of models with several token streams: one row per example, one part per stream.

Multi-stream methods return one map per stream (``attribute((a, b), return_tokens=True)``
gives a tuple). Each part has its own colour scale, stated in its legend: streams differ in
size and units (a text token vs an image pixel), so one shared number would favour one.

* ``text_image_view``: CLIP-like models, text tokens beside the image overlay;
* ``text_regions_view``: LXMERT / VisualBERT, text tokens beside the region scores (a strip
  "region 0 .. R-1", and the region boxes drawn over the image when both are given);
* ``detection_view``: DETR, each explained detection's map over its image with its box.

Signed or not is the method's (``signed=name in SIGNED_METHODS`` of
``captum_transformers.methods.catalog``), the same for every part of a view: with
``signed=None`` each part only GUESSES from its own values (signed when one is negative), so
an AttnLRP image map with no negative pixel would lose its signed legend and its sum.

>>> text, image = GenericAttention(clip).attribute((ids, pixels))                       # doctest: +SKIP
>>> text_image_view(tokens, text, pictures, image, special_tokens={"<|endoftext|>"})    # doctest: +SKIP
"""
from __future__ import annotations

import io
from typing import List, Optional, Sequence

import torch

from ..errors import InputError
from .colors import ColorScale, as_float_tensor
from .images import ImageOverlay, display_image, draw_box, enlarge, image_overlay, zoom_factor
from .output import Picture, escape
from .tokens import TokenHeatmap, boolean_attention_mask


class StreamView(Picture):
    """Rows of parts (``TokenHeatmap``, ``ImageOverlay``...), each part a stream of one example."""

    def __init__(self, rows: Sequence[Sequence[Picture]], titles: Sequence[str], title: str):
        if len(rows) != len(titles):
            raise InputError(f"got {len(titles)} titles for {len(rows)} rows; expected one per row.")
        self.rows = [list(parts) for parts in rows]
        self.titles = [str(t) for t in titles]
        self.title = str(title)

    def _body_html(self) -> str:
        parts = [f"<h3>{escape(self.title)}</h3><table>"]
        for title, row in zip(self.titles, self.rows):
            cells = "".join(f"<td style='text-align:left'>{part._body_html()}</td>" for part in row)
            parts.append(f"<tr><th class='name'>{escape(title)}</th>{cells}</tr>")
        return "".join(parts) + "</table>"

    def to_png(self) -> bytes:
        """The parts' own PNGs (each with its colour bar) side by side, one row per example."""
        from PIL import Image

        rows = [[Image.open(io.BytesIO(part.to_png())).convert("RGB") for part in row] for row in self.rows]
        width = max(sum(image.width for image in row) for row in rows)
        height = sum(max(image.height for image in row) for row in rows)
        sheet = Image.new("RGB", (width, height), "white")
        y = 0
        for row in rows:
            x = 0
            for image in row:
                sheet.paste(image, (x, y))
                x += image.width
            y += max(image.height for image in row)
        buffer = io.BytesIO()
        sheet.save(buffer, format="PNG")
        return buffer.getvalue()

    def to_svg(self) -> str:
        import base64

        from PIL import Image

        png = self.to_png()
        width, height = Image.open(io.BytesIO(png)).size
        return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}'>"
                f"<title>{escape(self.title)}</title><image width='{width}' height='{height}' "
                f"href='data:image/png;base64,{base64.b64encode(png).decode('ascii')}'/></svg>")


def _batch(values, count: int, what: str) -> torch.Tensor:
    tensor = as_float_tensor(values, what)
    if tensor.shape[0] != count:
        raise InputError(f"{what} has {tensor.shape[0]} rows; expected {count}, one per example.")
    return tensor


def _titles(titles: Optional[Sequence[str]], count: int) -> List[str]:
    titles = [f"example {row}" for row in range(count)] if titles is None else [str(t) for t in titles]
    if len(titles) != count:
        raise InputError(f"got {len(titles)} titles for {count} examples; expected one per example.")
    return titles


def _text_row(tokens, text_scores, row: int, special_tokens, attention_mask, merge_word_pieces,
              signed: Optional[bool] = None) -> TokenHeatmap:
    """The token heatmap of example ``row`` (its own padding mask)."""
    mask = boolean_attention_mask(attention_mask)  # a tensor, or the tokenizer's output / a dict holding it
    mask = None if mask is None else mask[row:row + 1]
    return TokenHeatmap([list(tokens[row])], {"text": text_scores[row:row + 1]}, special_tokens=special_tokens,
                        attention_mask=mask, merge_word_pieces=merge_word_pieces, title="text", signed=signed)


def text_image_view(tokens: Sequence[Sequence[str]], text_scores, images, image_maps, *,
                    titles: Optional[Sequence[str]] = None, special_tokens=(), attention_mask=None,
                    merge_word_pieces: bool = False, patch_grid=None, title: str = "Text and image relevance",
                    signed: Optional[bool] = None) -> StreamView:
    """CLIP-like views: per example, its token heatmap beside its image overlay (``signed``:
    whether the method's maps are signed; None guesses per part, see the module docstring)."""
    count = len(tokens)
    text_scores = _batch(text_scores, count, "text_scores")
    image_maps = _batch(image_maps, count, "image_maps")
    titles = _titles(titles, count)
    rows = []
    for row in range(count):
        text = _text_row(tokens, text_scores, row, special_tokens, attention_mask, merge_word_pieces, signed)
        rows.append([text, image_overlay(images[row], image_maps[row], title="image", patch_grid=patch_grid,
                                         signed=signed)])
    return StreamView(rows, titles, title)


class RegionBoxes(ImageOverlay):
    """An image (dimmed) with each region's box drawn in its relevance colour, strongest on top."""


def region_boxes(image, scores: torch.Tensor, boxes, title: str = "regions",
                 signed: Optional[bool] = None) -> RegionBoxes:
    """``boxes`` (R, 4): ``(x0, y0, x1, y1)`` as fractions of the image (LXMERT's visual_pos);
    ``signed`` as in the module docstring (None: a guess from ``scores``)."""
    pixels = display_image(image)
    height, width = pixels.shape[:2]
    boxes = as_float_tensor(boxes, "boxes")
    if boxes.shape != (scores.shape[0], 4):
        raise InputError(f"boxes have shape {tuple(boxes.shape)}; expected ({scores.shape[0]}, 4): one "
                         "(x0, y0, x1, y1) in [0, 1] per region.")
    scale = ColorScale.fit([scores], signed=signed)
    factor = zoom_factor(height, width)
    rgb = enlarge((pixels * 0.5 * 255 + 127).round().to(torch.uint8), factor)
    colours = scale.rgb(scores)
    for index in scores.abs().argsort().tolist():  # the strongest region is drawn last, on top
        x0, y0, x1, y1 = boxes[index].tolist()
        rgb = draw_box(rgb, (x0 * width, y0 * height, x1 * width, y1 * height), tuple(colours[index].tolist()),
                       factor)
    return RegionBoxes(rgb, scale, title)


def text_regions_view(tokens: Sequence[Sequence[str]], text_scores, region_scores, *, images=None, boxes=None,
                      titles: Optional[Sequence[str]] = None, special_tokens=(), attention_mask=None,
                      merge_word_pieces: bool = False, title: str = "Text and region relevance",
                      signed: Optional[bool] = None) -> StreamView:
    """LXMERT / VisualBERT views: per example, its token heatmap, its region scores as a strip
    ("region 0" ... in feature order), and with ``images`` and ``boxes`` ((B, R, 4) fractions
    of the image, as LXMERT's ``visual_pos``) the boxes over the image. ``signed``: whether the
    method's maps are signed (None guesses per part, see the module docstring)."""
    count = len(tokens)
    text_scores = _batch(text_scores, count, "text_scores")
    region_scores = _batch(region_scores, count, "region_scores")
    if (images is None) != (boxes is None):
        raise InputError("give both images and boxes (to draw the regions over the image), or neither.")
    titles = _titles(titles, count)
    rows = []
    for row in range(count):
        text = _text_row(tokens, text_scores, row, special_tokens, attention_mask, merge_word_pieces, signed)
        names = [f"region {index}" for index in range(region_scores.shape[1])]
        regions = TokenHeatmap([names], {"regions": region_scores[row:row + 1]}, title="regions", signed=signed)
        parts: List[Picture] = [text, regions]
        if images is not None:
            parts.append(region_boxes(images[row], region_scores[row], torch.as_tensor(boxes)[row], signed=signed))
        rows.append(parts)
    return StreamView(rows, titles, title)


def detection_view(images, detections, *, pred_boxes=None, class_names: Optional[Sequence[str]] = None,
                   title: str = "Detections", signed: Optional[bool] = None) -> StreamView:
    """DETR views: one row per image, one picture per explained detection of it
    (``explain_detections``' result): its map over the image, and with ``pred_boxes`` (the model output's (B, Q, 4) boxes: centre x,
    centre y, width, height as fractions of the image) its box in yellow. ``signed``: whether the
    method's maps are signed (None guesses per map, see the module docstring)."""
    maps = detections.maps[0] if isinstance(detections.maps, tuple) else detections.maps
    by_image = {}
    for d in range(len(detections)):
        image_index, query = int(detections.image_index[d]), int(detections.query_index[d])
        label = int(detections.label[d])
        name = class_names[label] if class_names is not None and 0 <= label < len(class_names) else f"class {label}"
        boxes = ()
        if pred_boxes is not None:
            pixels = display_image(images[image_index])
            height, width = pixels.shape[:2]
            cx, cy, w, h = torch.as_tensor(pred_boxes)[image_index, query].tolist()
            boxes = [((cx - w / 2) * width, (cy - h / 2) * height, (cx + w / 2) * width, (cy + h / 2) * height)]
        caption = f"query {query}: {name} {float(detections.score[d]):.2f}"
        by_image.setdefault(image_index, []).append(image_overlay(images[image_index], maps[d], title=caption,
                                                                  boxes=boxes, signed=signed))
    if not by_image:
        raise InputError("no detection to draw (D = 0): lower explain_detections' threshold.")
    return StreamView(list(by_image.values()), [f"image {index}" for index in by_image], title)
