"""One generated token of a vision-language model: its map over the image beside its text evidence.

``GenerationImageView(result, image, output_index=t)`` draws ``result.image_attr[t]`` (the
token's map over the image's pixels, from ``GenerationAttribution(..., images=...)``) over the
image, next to :class:`~captum_transformers.visualization.GenerationText` of the same token
(the prompt's text tokens and the earlier output, coloured by what the token read). The image
map has its own colour scale (signed for a signed method), stated in its colour bar; the text
keeps the row's scale. ``image_index`` picks the image of a prompt with several.

>>> GenerationImageView(result, canvas, output_index=1, outline=digit_mask).save("why_second_digit.png")  # doctest: +SKIP
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import InputError
from .generation_text import GenerationText
from .images import add_colorbar, image_overlay
from .output import Picture, agg_figure, escape, plain_text

IMAGE_INCHES = 3.0


def _image_map(result, output_index: int, image_index: int) -> torch.Tensor:
    """The (H, W) map of output token ``output_index`` over image ``image_index``, checked."""
    maps = getattr(result, "image_attr", None)
    if maps is None:
        raise InputError("this result has no image_attr: explain a vision-language model with "
                         "GenerationAttribution(method, tokenizer).attribute(prompt, images=pixel_values) first.")
    maps = list(maps) if isinstance(maps, (list, tuple)) else [maps]
    if isinstance(image_index, bool) or not isinstance(image_index, int) or not -len(maps) <= image_index < len(maps):
        raise InputError(f"image_index={image_index!r}: this result holds {len(maps)} image map(s); pass an int in "
                         f"[{-len(maps)}, {len(maps)}).")
    chosen = maps[image_index]
    rows = chosen.shape[0]
    if not -rows <= output_index < rows:
        raise InputError(f"output_index={output_index!r}: the image map has {rows} row(s), one per output token.")
    return chosen[output_index].detach().float().cpu()


class GenerationImageView(Picture):
    """The chosen output token's image map over the image, beside its text view (module docstring).

    Args:
        result: a ``GenerationResult`` with ``image_attr``.
        image: the image as the model read it, (C, H, W) or (H, W, C), floats in [0, 1] (or uint8):
            draw the unnormalized image; the map must have its height and width.
        output_index: which generated token (negative counts from the end).
        image_index: which image of the prompt.
        outline: an optional boolean (H, W) mask drawn in green (e.g. the object the token names).
        percentile: the image scale's limit, a percentile of ``|map|`` (99: one hot pixel does not
            wash the rest out; 100: the maximum).
        merge_words: as for ``GenerationText``.
        skip: as for ``GenerationText``.
        special_tokens: as for ``GenerationText``.
        title: the picture's title (default: the explained token's).
    """

    def __init__(self, result, image, output_index: int = 0, *, image_index: int = 0, outline=None,
                 percentile: float = 99.0, merge_words: bool = False, skip=None, special_tokens=None,
                 title: Optional[str] = None):
        self.text = GenerationText(result, output_index, merge_words, skip=skip, special_tokens=special_tokens)
        values = _image_map(result, self.text.output_index, image_index)
        self.title = str(title) if title is not None else self.text.title
        self.text.title = "text it read"
        self.values = values
        self.overlay = image_overlay(image, values, signed=self.text.signed, outline=outline, percentile=percentile,
                                     title=f"image map of {self.text.token!r}")

    def _body_html(self) -> str:
        return (f"<h3>{escape(self.title)}</h3><table><tr><td style='vertical-align:top'>{self.overlay._body_html()}"
                f"</td><td style='text-align:left;vertical-align:top'>{self.text._body_html()}</td></tr></table>")

    def _figure(self):
        text_width, text_height = self.text.panel_size()
        height = max(text_height, IMAGE_INCHES + 0.9) + 0.35
        width = IMAGE_INCHES + 0.3 + text_width
        figure = agg_figure(width, height)
        figure.text(0.1 / width, 1 - 0.22 / height, plain_text(self.title), fontsize=9, weight="bold")
        top = height - 0.35
        axis = figure.add_axes((0.15 / width, (top - IMAGE_INCHES - 0.25) / height, IMAGE_INCHES / width,
                                IMAGE_INCHES / height))
        axis.imshow(self.overlay.rgb.numpy(), interpolation="nearest")
        axis.set_axis_off()
        axis.set_title(plain_text(self.overlay.title), fontsize=8)
        add_colorbar(figure, (0.45 / width, (top - IMAGE_INCHES - 0.6) / height, (IMAGE_INCHES - 0.6) / width,
                              0.1 / height), self.overlay.scale)
        if self.overlay.caption:
            figure.text(0.15 / width, (top - IMAGE_INCHES - 0.85) / height, plain_text(self.overlay.caption), fontsize=6)
        self.text.draw(figure, (IMAGE_INCHES + 0.3, top - text_height))
        return figure
