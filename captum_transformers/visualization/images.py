"""A relevance map drawn over its image.

The overlay of a value ``v`` at a pixel of image colour ``p`` (in [0, 1]) is

    alpha = opacity * |v| / limit            (clipped to [0, opacity])
    out   = (1 - alpha) * 255 * p + alpha * colour(v)

so a pixel of zero relevance shows the image itself (the neutral colour of an overlay), and
the stronger the relevance, the more of the scale's colour (red +, blue -; see ``colors``)
covers it. A map smaller than the image by an integer factor (a ViT's patch grid) is
enlarged by repetition, each patch a block; a (C, H, W) map is summed over its channels.

>>> overlay = image_overlay(canvas, relevance, title="AttnLRP", patch_grid=(8, 8))  # doctest: +SKIP
>>> overlay.save("attnlrp.png")                                                       # doctest: +SKIP
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

from ..errors import InputError
from .colors import ColorScale, as_float_tensor
from .output import Picture, agg_figure, data_uri, escape, legend_html, plain_text, png_bytes

MIN_DISPLAY_SIDE = 160  # small canvases (32 x 32) are enlarged to at least this many pixels
OUTLINE = (0, 200, 0)
GRID_LINE = (128, 128, 128)


def display_image(image, what: str = "image") -> torch.Tensor:
    """``image`` as (H, W, 3) floats in [0, 1]. Takes (3, H, W), (1, H, W), (H, W, 3), (H, W, 1)
    or (H, W) tensors or arrays, uint8 (0..255) or floats in [0, 1], or a PIL image. Normalised model inputs are refused: their
    colours would be made up."""
    if hasattr(image, "getbands") and hasattr(image, "convert"):  # a PIL image
        import numpy

        image = numpy.asarray(image.convert("RGB"))
    is_bytes = (isinstance(image, torch.Tensor) and image.dtype == torch.uint8) or \
        getattr(getattr(image, "dtype", None), "name", "") == "uint8"
    tensor = as_float_tensor(image, what)
    if is_bytes:
        tensor = tensor / 255.0
    if tensor.dim() == 2:
        tensor = tensor.unsqueeze(-1)
    if tensor.dim() != 3:
        raise InputError(f"{what} has shape {tuple(tensor.shape)}; expected one image: (3, H, W), (H, W, 3) or "
                         "(H, W). Pass image[i] for one image of a batch.")
    if tensor.shape[0] in (1, 3) and tensor.shape[-1] not in (1, 3):
        tensor = tensor.permute(1, 2, 0)
    if tensor.shape[-1] not in (1, 3):
        raise InputError(f"{what} has shape {tuple(tensor.shape)}: found no colour axis of size 1 or 3.")
    if tensor.shape[-1] == 1:
        tensor = tensor.expand(-1, -1, 3)
    low, high = float(tensor.min()), float(tensor.max())
    if low < -1e-3 or high > 1 + 1e-3:
        raise InputError(f"{what} has values in [{low:.3g}, {high:.3g}]; expected colours in [0, 1] (or uint8). "
                         "Pass the image before normalisation (e.g. the canvas, not normalize(canvas)).")
    return tensor.clamp(0, 1)


def map_to_pixels(attribution, height: int, width: int, what: str = "attribution") -> torch.Tensor:
    """``attribution`` as an (height, width) map: (H, W) as is, (C, H, W) summed over channels
    (signs kept), a smaller (h, w) grid with ``height % h == width % w == 0`` repeated into
    blocks. Anything else is refused with the shapes."""
    values = as_float_tensor(attribution, what)
    if values.dim() == 4 and values.shape[0] == 1:  # a batch of one
        values = values[0]
    if values.dim() == 3:
        values = values.sum(0)
    if values.dim() != 2:
        raise InputError(f"{what} has shape {tuple(values.shape)}; expected (H, W) or (C, H, W) for one image. "
                         "Token scores (N,) must first be reshaped to the patch grid, e.g. scores[1:].reshape(8, 8) "
                         "without the CLS token.")
    rows, cols = values.shape
    if (rows, cols) == (height, width):
        return values
    if height % rows or width % cols:
        raise InputError(f"{what} has a {rows} x {cols} map for a {height} x {width} image; expected the image's "
                         "size or a grid that divides it (e.g. 8 x 8 patches of a 32 x 32 image).")
    return values.repeat_interleave(height // rows, 0).repeat_interleave(width // cols, 1)


def blend(image: torch.Tensor, values: torch.Tensor, scale: ColorScale, opacity: float) -> torch.Tensor:
    """The overlay (H, W, 3) uint8 of ``values`` (H, W) over ``image`` (H, W, 3) in [0, 1]."""
    if not 0 <= opacity <= 1:
        raise InputError(f"opacity must be in [0, 1], got {opacity!r}.")
    alpha = (opacity * scale.normalized(values).abs()).unsqueeze(-1)
    mixed = (1 - alpha) * 255.0 * image + alpha * scale.rgb(values).float()
    return mixed.round().clamp(0, 255).to(torch.uint8)


def zoom_factor(height: int, width: int) -> int:
    return max(1, math.ceil(MIN_DISPLAY_SIDE / max(1, min(height, width))))


def enlarge(rgb: torch.Tensor, factor: int) -> torch.Tensor:
    return rgb.repeat_interleave(factor, 0).repeat_interleave(factor, 1) if factor > 1 else rgb


def draw_patch_grid(rgb: torch.Tensor, grid: Tuple[int, int]) -> torch.Tensor:
    """Grey lines between the cells of a ``(rows, cols)`` patch grid (in place on a copy)."""
    rows, cols = grid
    height, width = rgb.shape[:2]
    if rows < 1 or cols < 1 or height % rows or width % cols:
        raise InputError(f"patch_grid={grid!r} does not divide the {height} x {width} drawing; expected "
                         "(rows, cols) of the model's patches, e.g. (8, 8) for 4 x 4 patches of 32 x 32.")
    out = rgb.clone()
    for row in range(1, rows):
        out[row * height // rows, :] = torch.tensor(GRID_LINE, dtype=torch.uint8)
    for col in range(1, cols):
        out[:, col * width // cols] = torch.tensor(GRID_LINE, dtype=torch.uint8)
    return out


def draw_outline(rgb: torch.Tensor, mask: torch.Tensor, factor: int) -> torch.Tensor:
    """The boundary of a boolean mask (in image pixels) drawn in green on an enlarged drawing."""
    mask = enlarge(torch.as_tensor(mask).bool().unsqueeze(-1), factor)[..., 0]
    if mask.shape != rgb.shape[:2]:
        raise InputError(f"outline mask has shape {tuple(mask.shape)} after enlarging; expected the image's "
                         f"{tuple(rgb.shape[:2])}.")
    padded = torch.nn.functional.pad(mask[None, None].float(), (1, 1, 1, 1), value=0.0)
    eroded = -torch.nn.functional.max_pool2d(-padded, 3, stride=1)[0, 0] > 0.5
    out = rgb.clone()
    out[mask & ~eroded] = torch.tensor(OUTLINE, dtype=torch.uint8)
    return out


def draw_box(rgb: torch.Tensor, box: Sequence[float], colour: Tuple[int, int, int], factor: int) -> torch.Tensor:
    """A 2-pixel rectangle ``(x0, y0, x1, y1)`` given in image pixels."""
    height, width = rgb.shape[:2]
    x0, y0, x1, y1 = (int(round(float(v) * factor)) for v in box)
    x0, x1 = sorted((min(max(x0, 0), width - 1), min(max(x1, 0), width - 1)))
    y0, y1 = sorted((min(max(y0, 0), height - 1), min(max(y1, 0), height - 1)))
    out = rgb.clone()
    paint = torch.tensor(colour, dtype=torch.uint8)
    out[y0:y0 + 2, x0:x1 + 1] = paint
    out[max(y1 - 1, 0):y1 + 1, x0:x1 + 1] = paint
    out[y0:y1 + 1, x0:x0 + 2] = paint
    out[y0:y1 + 1, max(x1 - 1, 0):x1 + 1] = paint
    return out


class ImageOverlay(Picture):
    """One map over one image. ``rgb`` is the drawing ((H * zoom, W * zoom, 3) uint8),
    ``scale`` its colour scale; shows itself in notebooks and saves to .png/.svg/.html."""

    def __init__(self, rgb: torch.Tensor, scale: ColorScale, title: str = "", caption: str = ""):
        self.rgb, self.scale, self.title, self.caption = rgb, scale, str(title), str(caption)

    def image_png(self) -> bytes:
        """PNG bytes of the drawing alone (no title or colour bar)."""
        return png_bytes(self.rgb)

    def _body_html(self) -> str:
        caption = f"<div>{escape(self.caption)}</div>" if self.caption else ""
        return (f"<figure style='margin:4px;display:inline-block'><figcaption><b>{escape(self.title)}</b></figcaption>"
                f"<img src='{data_uri(self.image_png())}' width='{self.rgb.shape[1]}' alt='{escape(self.title)}'>"
                f"{caption}{legend_html(self.scale)}</figure>")

    def _figure(self):
        height, width = self.rgb.shape[:2]
        figure = agg_figure(3.2, 3.2 * height / width + 0.9)
        axis = figure.add_axes((0.05, 0.22, 0.9, 0.68))
        axis.imshow(self.rgb.numpy(), interpolation="nearest")
        axis.set_axis_off()
        axis.set_title(plain_text(self.title), fontsize=9)
        add_colorbar(figure, (0.15, 0.1, 0.7, 0.04), self.scale)
        if self.caption:
            figure.text(0.5, 0.01, plain_text(self.caption), ha="center", fontsize=7)
        return figure


def add_colorbar(figure, rect, scale: ColorScale):
    """A horizontal colour bar of ``scale`` in ``rect`` (figure coordinates)."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import ListedColormap, Normalize

    from .colors import ramp

    stops = torch.linspace(-1.0 if scale.signed else 0.0, 1.0, 256)
    colormap = ListedColormap((ramp(stops).float() / 255).numpy())
    mappable = ScalarMappable(norm=Normalize(scale.low, scale.limit), cmap=colormap)
    axis = figure.add_axes(rect)
    bar = figure.colorbar(mappable, cax=axis, orientation="horizontal")
    bar.ax.tick_params(labelsize=6)
    ticks = [scale.low, 0.0, scale.limit] if scale.signed else [0.0, scale.limit]
    bar.set_ticks(ticks)
    bar.set_ticklabels([f"{tick:.2g}" for tick in ticks])
    return bar


def image_overlay(image, attribution, *, title: str = "", caption: str = "", signed: Optional[bool] = None,
                  limit: Optional[float] = None, percentile: float = 100.0, opacity: float = 0.85,
                  patch_grid: Optional[Tuple[int, int]] = None, outline=None, boxes: Sequence = (),
                  scale: Optional[ColorScale] = None, grayscale: bool = True, logit: Optional[float] = None
                  ) -> ImageOverlay:
    """Draw ``attribution`` over ``image`` (see the module docstring for the blend).

    ``signed``: True for a signed method's map (LRP, AttnLRP, gradient x input, Integrated
    Gradients: ``SIGNED_METHODS``), False for an unsigned one; ``signed=None`` only GUESSES
    from the data (diverging when a value is negative), so a signed map with no negative value
    would lose its signed legend and its sum: say it when you know the method. ``limit``
    fixes the scale (default: the ``percentile`` of ``|map|``, 100 = its maximum); ``scale``
    passes a ready ``ColorScale`` (shared by several overlays). ``patch_grid=(rows, cols)``
    draws the patch boundaries, ``outline`` a boolean (H, W) mask's edge in green, ``boxes``
    rectangles ``(x0, y0, x1, y1)`` in image pixels (e.g. DETR detections). ``grayscale``
    (default) draws the image under the map in grey: the colours then mean relevance only.
    A signed map gets the caption ``sum of relevance 1.83 · logit 2.10`` (the logit when
    ``logit``, the explained class's score, is given): a conservative method aims at equal numbers.
    """
    pixels = display_image(image)
    height, width = pixels.shape[:2]
    values = map_to_pixels(attribution, height, width)
    if scale is None:
        scale = ColorScale.fit([values], signed=signed, percentile=percentile, limit=limit)
    if scale.signed:
        total = float(as_float_tensor(attribution, "attribution").double().sum())
        sums = f"sum of relevance {total:.3g}" + (f" · logit {float(logit):.3g}" if logit is not None else "")
        caption = f"{caption} ({sums})" if caption else sums
    return ImageOverlay(draw(pixels, values, scale, opacity, patch_grid, outline, boxes, grayscale), scale, title,
                        caption)


def draw(pixels: torch.Tensor, values: torch.Tensor, scale: ColorScale, opacity: float,
         patch_grid=None, outline=None, boxes: Sequence = (), grayscale: bool = True) -> torch.Tensor:
    """The enlarged overlay drawing with its optional grid, outline and boxes. With
    ``grayscale`` the image under the map is drawn in grey (its mean over the colour
    channels), so that a red or blue of the image cannot pass for relevance."""
    factor = zoom_factor(*pixels.shape[:2])
    if grayscale:
        pixels = pixels.mean(-1, keepdim=True).expand_as(pixels)
    rgb = enlarge(blend(pixels, values, scale, opacity), factor)
    if patch_grid is not None:
        rgb = draw_patch_grid(rgb, tuple(patch_grid))
    if outline is not None:
        rgb = draw_outline(rgb, outline, factor)
    for box in boxes:
        rgb = draw_box(rgb, box, (255, 200, 0), factor)
    return rgb
