"""Methods x examples: one row per example (its image, then each method's overlay).

``ExplanationGrid(images, {method: maps})`` draws every map over its image with one colour
convention (``colors``) and a scale that is, by ``scale=``:

* ``"per-map"`` (default): each cell scaled by its own largest ``|value|`` (where each map
  looks; its range is printed above it);
* ``"per-method"``: one scale per column, so examples compare within a method;
* ``"shared"``: one scale for the whole grid (methods of the same units compare too);
* a number: that limit everywhere.

``percentile`` (default 100: the maximum) sets each limit at that percentile of ``|value|``
instead: per-pixel maps (LRP, gradients) have a few extreme pixels that would wash out the
rest (Captum's visualizer uses 98). Under the maps the image is drawn in grey
(``grayscale=False`` keeps its colours); the first column shows it in colour.

Signed maps (a diverging ``±range`` scale) read red = for the explained class, blue =
against; unsigned ones (GenericAttention, rollout: ``0..range``) read darker = more relevant,
with no direction; the legend says which is which. Which maps are signed is a property of the
METHOD, whatever the scale: ``signed=`` takes a bool or a ``{method: bool}`` dict; by default a
column named after a catalog method follows ``SIGNED_METHODS`` (``report`` passes it), and only
a column of another name is guessed from its data (signed when a value is negative). Under each signed map its relevance sum
is printed, and next to it the explained logit when ``logits`` (one per example) is given
(``report`` passes the model's own): ``sum 1.83 · logit 2.10``. Conservative methods aim at
equal numbers (docs/relevance-rules.md says how far the shipped models are from that).

The grid shows itself in a notebook and ``save``s to PNG, SVG or one self-contained HTML
file (``to_html(standalone=True)``: images as data: URIs, no script, opens offline).
``report(model, inputs)`` computes the maps, one ``attribute`` call per method on the batch.

>>> grid = report(load_digit_model(), normalize(canvases), images=canvases, methods=["rollout", "attn-lrp"])  # doctest: +SKIP
>>> grid.save("report.html")                                                                                   # doctest: +SKIP
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..capture.targets import output_scores, select_targets
from ..errors import InputError
from .colors import ColorScale, ScaleOption, SignedOption, as_float_tensor, common_scale, fit_scales, legend_words
from .images import add_colorbar, display_image, draw, enlarge, map_to_pixels, zoom_factor
from .output import Picture, agg_figure, data_uri, escape, legend_html, plain_text, png_bytes


class ExplanationGrid(Picture):
    """Examples as rows, methods as columns. ``cells[method][row]`` is the (H', W', 3) uint8
    drawing, ``scales[method][row]`` its ``ColorScale``."""

    def __init__(self, images, maps: Mapping[str, object], titles: Optional[Sequence[str]] = None, *,
                 scale: ScaleOption = "per-map", signed: SignedOption = None, percentile: float = 100.0,
                 opacity: float = 0.85, patch_grid: Optional[Tuple[int, int]] = None, outlines=None,
                 title: str = "Explanations", grayscale: bool = True, logits=None):
        if not isinstance(maps, Mapping) or not maps:
            raise InputError(f"maps must be a non-empty {{method_name: (B, ...) maps}} dict, got {type(maps).__name__}.")
        self.images = [display_image(image, f"image {row}") for row, image in enumerate(images)]
        count = len(self.images)
        if count == 0:
            raise InputError("ExplanationGrid needs at least one image.")
        self.titles = [str(t) for t in titles] if titles is not None else [f"example {row}" for row in range(count)]
        if len(self.titles) != count:
            raise InputError(f"got {len(self.titles)} titles for {count} images; expected one title per image.")
        self.title = str(title)
        pixel_maps: Dict[str, List[torch.Tensor]] = {}
        # Each map's sum over every value it holds (channels and pixels, or patches): the
        # relevance the method gives the whole input, before any resizing for the drawing.
        self.sums: Dict[str, List[float]] = {}
        self.logits = None if logits is None else as_float_tensor(logits, "logits").reshape(-1).tolist()
        if self.logits is not None and len(self.logits) != count:
            raise InputError(f"logits has {len(self.logits)} values for {count} images; expected one explained logit "
                             "per image.")
        for name, batch in maps.items():
            values = as_float_tensor(batch, f"maps[{name!r}]")
            if values.dim() < 3 or values.shape[0] != count:
                raise InputError(f"maps[{name!r}] has shape {tuple(values.shape)}; expected ({count}, H, W) or "
                                 f"({count}, C, H, W): one map per image.")
            self.sums[str(name)] = values.double().flatten(1).sum(1).tolist()
            pixel_maps[str(name)] = [map_to_pixels(values[row], *self.images[row].shape[:2], f"maps[{name!r}][{row}]")
                                     for row in range(count)]
        self.scale_mode = scale
        self.scales = fit_scales(pixel_maps, scale, signed, percentile)
        if outlines is not None and len(outlines) != count:
            raise InputError(f"got {len(outlines)} outlines for {count} images; expected one mask per image.")
        self.cells = {name: [draw(self.images[row], pixel_maps[name][row], self.scales[name][row], opacity,
                                  patch_grid, None if outlines is None else outlines[row], grayscale=grayscale)
                             for row in range(count)] for name in pixel_maps}

    @property
    def methods(self) -> List[str]:
        return list(self.cells)

    def conservation_caption(self, name: str, row: int, short: bool = False) -> str:
        """``sum of relevance 1.83 · logit 2.10`` under a signed map (the logit when given); ""
        under an unsigned one, whose sum is no amount of evidence."""
        if not self.scales[name][row].signed:
            return ""
        caption = f"{'sum' if short else 'sum of relevance'} {self.sums[name][row]:.3g}"
        return caption + (f" · logit {self.logits[row]:.3g}" if self.logits is not None else "")

    def legend_words(self) -> str:
        """What the colours mean, for the signed and/or unsigned maps of this grid."""
        return legend_words([s for name in self.methods for s in self.scales[name]],
                            [name for name in self.methods for _ in self.scales[name]])

    def _image_cell(self, row: int) -> torch.Tensor:
        image = self.images[row]
        return enlarge((image * 255).round().to(torch.uint8), zoom_factor(*image.shape[:2]))

    def _body_html(self) -> str:
        head = "".join(f"<th>{escape(name)}</th>" for name in self.methods)
        rows = []
        for row in range(len(self.images)):
            picture = self._image_cell(row)
            cells = [f"<td><img src='{data_uri(png_bytes(picture))}' width='{picture.shape[1]}' "
                     f"alt='{escape(self.titles[row])}'><div>{escape(self.titles[row])}</div></td>"]
            for name in self.methods:
                legend = legend_html(self.scales[name][row], compact=True) if self.scale_mode == "per-map" else ""
                caption = self.conservation_caption(name, row)
                legend += f"<div class='legend'>{escape(caption)}</div>" if caption else ""
                cells.append(f"<td><img src='{data_uri(png_bytes(self.cells[name][row]))}' "
                             f"width='{self.cells[name][row].shape[1]}' alt='{escape(name)}'>{legend}</td>")
            rows.append("<tr>" + "".join(cells) + "</tr>")
        if self.scale_mode == "per-map":
            footer = ""
        elif self.scale_mode == "per-method":
            footer = "<tr><td>scale per method</td>" + "".join(
                f"<td>{legend_html(self.scales[name][0], compact=True)}</td>" for name in self.methods) + "</tr>"
        else:
            footer = (f"<tr><td colspan='{len(self.methods) + 1}'>one limit for every map: "
                      f"{legend_html(common_scale(self.scales))}</td></tr>")
        return (f"<h3>{escape(self.title)}</h3><table><tr><th>input</th>{head}</tr>{''.join(rows)}{footer}</table>"
                f"<p class='legend'>Overlays: {escape(self.legend_words())} A pixel of zero relevance shows the "
                "image itself.</p>")

    def _cell_label(self, name: str, row: int) -> str:
        # A long title with a parenthesised note ("integrated-gradients (Captum baseline)") is
        # drawn on two lines, so neighbouring column titles do not run into each other.
        title = name.replace(" (", "\n(", 1) if len(name) > 20 else name
        label = plain_text(title) if row == 0 else ""
        if self.scale_mode == "per-map":
            scale = self.scales[name][row]
            label = (label + "\n" if label else "") + (f"±{scale.limit:.2g}" if scale.signed else f"0..{scale.limit:.2g}")
        caption = self.conservation_caption(name, row, short=True)
        return (label + "\n" if label else "") + caption if caption else label

    def mosaic(self, gutter: int = 8, band: int = 30) -> torch.Tensor:
        """Every cell on one white (H, W, 3) uint8 sheet: ``band`` pixels above each row for its
        labels, ``gutter`` pixels between cells (one image drawn once: fast to save)."""
        cells = [[self._image_cell(row)] + [self.cells[name][row] for name in self.methods]
                 for row in range(len(self.images))]
        height = max(cell.shape[0] for line in cells for cell in line)
        width = max(cell.shape[1] for line in cells for cell in line)
        sheet = torch.full((len(cells) * (height + band), len(cells[0]) * (width + gutter), 3), 255, dtype=torch.uint8)
        for row, line in enumerate(cells):
            for col, cell in enumerate(line):
                top, left = row * (height + band) + band, col * (width + gutter) + gutter // 2
                sheet[top:top + cell.shape[0], left:left + cell.shape[1]] = cell
        return sheet

    def _band(self) -> int:
        """Pixels above each row for its labels: name, range and (signed maps) the sum line."""
        lines = max(self._cell_label(name, row).count("\n") + 1 for name in self.methods
                    for row in range(len(self.images)))
        return max(30, 10 * lines + 6)

    def _figure(self, dpi: int = 110):
        gutter, band = 8, self._band()
        sheet = self.mosaic(gutter, band)
        rows, cols = len(self.images), len(self.methods) + 1
        cell_height, cell_width = sheet.shape[0] // rows - band, sheet.shape[1] // cols - gutter
        bar_pixels = 75
        figure = agg_figure(sheet.shape[1] / dpi, (sheet.shape[0] + bar_pixels) / dpi)
        axis = figure.add_axes((0, bar_pixels / (sheet.shape[0] + bar_pixels), 1,
                                sheet.shape[0] / (sheet.shape[0] + bar_pixels)))
        axis.imshow(sheet.numpy(), interpolation="nearest")
        axis.set_axis_off()
        for row in range(rows):
            for col in range(cols):
                label = plain_text(self.titles[row]) if col == 0 else self._cell_label(self.methods[col - 1], row)
                centre = col * (cell_width + gutter) + gutter // 2 + cell_width / 2
                axis.text(centre, row * (cell_height + band) + band - 3, label, ha="center", va="bottom", fontsize=6)
        total = sheet.shape[0] + bar_pixels
        bottom, thickness = 45 / total, 10 / total  # the colour bars: 10 pixels high, 45 above the edge (words below)
        if self.scale_mode in ("shared",) or isinstance(self.scale_mode, (int, float)):
            add_colorbar(figure, (0.3, bottom, 0.4, thickness), common_scale(self.scales))
        elif self.scale_mode == "per-method":
            for col, name in enumerate(self.methods, start=1):
                add_colorbar(figure, (col / cols + 0.02, bottom, 1 / cols - 0.04, thickness), self.scales[name][0])
        else:  # per map: one bar in units of each cell's range (printed above the cell)
            signed = any(s.signed for group in self.scales.values() for s in group)
            bar = add_colorbar(figure, (0.3, bottom, 0.4, thickness), ColorScale(signed, 1.0))
            bar.set_ticklabels(["-range", "0", "+range"] if signed else ["0", "range"])
        figure.text(0.5, 2 / total, plain_text(self.legend_words()), ha="center", va="bottom", fontsize=5,
                    wrap=True, color="#333")
        return figure


def report(model, inputs, *, methods: Optional[Sequence[str]] = None, target=None, images=None,
           titles: Optional[Sequence[str]] = None, forward_kwargs=None, **grid_options) -> ExplanationGrid:
    """Explain ``inputs`` with each method of the catalog (``methods``: short names, default
    all) in one ``attribute`` call per method, and draw the methods x examples grid.

    ``images`` are what is drawn (in [0, 1]); by default ``inputs`` themselves, which must then
    be in [0, 1] (a normalised batch is refused by the drawing: pass the raw images).
    ``target`` takes Captum's forms (None: the predicted class). Other keyword arguments go to
    ``ExplanationGrid`` (``scale``, ``patch_grid``, ``outlines``, ``title``...). Each method's
    maps are labelled signed or unsigned by the catalog (``SIGNED_METHODS``), whatever the
    scale or the values; a ``signed={name: bool}`` dict overrides names it gives.
    """
    from ..methods.catalog import METHOD_NAMES, build_method

    if isinstance(inputs, torch.Tensor) and not inputs.is_floating_point():
        raise InputError(f"report draws image models; got {inputs.dtype} inputs of shape {tuple(inputs.shape)} "
                         "(token ids?). For text, draw return_tokens=True scores with TokenHeatmap.")
    names = list(METHOD_NAMES if methods is None else methods)
    unknown = [name for name in names if name not in METHOD_NAMES]
    if unknown:
        raise InputError(f"unknown method(s) {unknown}; expected names of the catalog: {list(METHOD_NAMES)}.")
    maps = {}
    for name in names:
        attribution = build_method(name, model).attribute(inputs, target=target, forward_kwargs=forward_kwargs)
        maps[name] = (attribution[0] if isinstance(attribution, tuple) else attribution).detach()
    if "logits" not in grid_options:
        grid_options["logits"] = explained_logits(model, inputs, target, forward_kwargs)
    return ExplanationGrid(inputs if images is None else images, maps, titles, **grid_options)


@torch.no_grad()
def explained_logits(model, inputs, target=None, forward_kwargs=None) -> Optional[torch.Tensor]:
    """The logit of ``target`` (None: the predicted class) per example, from one forward pass;
    None when the output is not a (B, classes) score matrix (then no logit is printed)."""
    try:
        scores = output_scores(model(inputs, **(forward_kwargs or {})))
        scores = scores[0] if isinstance(scores, tuple) else scores
        if not isinstance(scores, torch.Tensor) or scores.dim() != 2:
            return None
        return select_targets(scores, target)[0].float().cpu()
    except InputError:  # a target or output of another form: no logit rather than a wrong one
        return None
