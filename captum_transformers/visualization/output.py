"""How every picture of this package shows itself and is written to a file.

A ``Picture`` displays itself in Jupyter, VS Code and Colab (``_repr_html_``; ``to_png()`` for
front ends without HTML) and saves to ``.html`` (one self-contained file: images embedded as ``data:``
URIs, no script, no CDN, opens offline), ``.png`` or ``.svg``. Every user string (titles,
class names, tokens) goes through ``escape`` before it reaches HTML, and through
``plain_text`` before matplotlib draws it (where ``$...$`` would otherwise be read as maths).
"""
from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Union

import torch

from ..errors import InputError
from .colors import ColorScale, css_gradient

BODY_STYLE = "body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:16px;color:#222}"
# Every rule below is scoped to .ctv, so that a fragment shown in a notebook restyles nothing else.
PAGE_STYLE = (
    ".ctv{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;font-size:13px}"
    ".ctv table{border-collapse:collapse} .ctv td,.ctv th{padding:3px;vertical-align:top;text-align:center}"
    ".ctv th{font-weight:600;font-size:12px} .ctv img{image-rendering:pixelated;display:block;margin:auto}"
    ".ctv .bar{display:inline-block;width:180px;height:10px;border:1px solid #999;vertical-align:middle}"
    ".ctv .legend{font-size:11px;color:#444;margin:4px 0}"
    ".ctv .tok{display:inline-block;padding:1px 3px;margin:1px;border-radius:2px;white-space:pre}"
    ".ctv .special{color:#888;font-style:italic;border:1px dashed #bbb}"
    ".ctv .name{text-align:right;white-space:nowrap;font-size:12px;padding-right:8px}"
)


def escape(text) -> str:
    """``str(text)`` safe as HTML text or a quoted attribute value (``<``, ``>``, ``&``, quotes)."""
    return html.escape(str(text), quote=True)


def plain_text(text) -> str:
    """``str(text)`` drawn literally by matplotlib: ``$`` escaped so that no mathtext is parsed."""
    return str(text).replace("$", r"\$")


def png_bytes(rgb: torch.Tensor) -> bytes:
    """PNG file bytes of a (H, W, 3) uint8 image."""
    try:
        from PIL import Image
    except ImportError:
        raise InputError("PNG output needs Pillow: pip install 'captum_transformers[viz]'.") from None
    buffer = io.BytesIO()
    Image.fromarray(rgb.contiguous().numpy(), mode="RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def legend_html(scale: ColorScale, note: str = "", compact: bool = False) -> str:
    """A colour bar with its numbers: the scale stated next to the picture (``compact``: a short
    bar without the words, for one cell of a grid whose footer says what the colours mean)."""
    low = f"-{scale.limit:.3g}" if scale.signed else "0"
    words = "" if compact else (" (blue against, white 0, red for)" if scale.signed
                                else " (darker = more relevant; unsigned: no direction)")
    text = f" {escape(note)}" if note else ""
    width = " style='width:70px'" if compact else ""
    return (f"<div class='legend'>{low} <span class='bar'{width}><span style='display:block;height:100%;"
            f"background:{css_gradient(scale)}'></span></span> +{scale.limit:.3g}{words}{text}</div>")


def standalone_page(body: str, title: str) -> str:
    """A complete HTML document around ``body``: inline style only, nothing fetched, no script."""
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'>"
            "<meta http-equiv='Content-Security-Policy' content=\"default-src 'none'; img-src data:; "
            "style-src 'unsafe-inline'\">"
            f"<title>{escape(title)}</title><style>{BODY_STYLE}{PAGE_STYLE}</style></head><body>{body}</body></html>")


def agg_figure(width: float, height: float):
    """A matplotlib Figure on its own Agg canvas: pyplot and the session's backend are left alone."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise InputError("PNG/SVG drawings need matplotlib: pip install 'captum_transformers[viz]'.") from None
    figure = Figure(figsize=(width, height))
    FigureCanvasAgg(figure)
    return figure


def figure_bytes(figure, file_format: str, dpi: int = 110) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format=file_format, dpi=dpi)
    return buffer.getvalue()


class Picture:
    """Base of the displayable objects: subclasses give ``_body_html()`` and ``_figure()``
    (a matplotlib Figure) or override ``to_png``/``to_svg``."""

    title: str = ""

    def _body_html(self) -> str:
        raise NotImplementedError

    def _figure(self):
        raise NotImplementedError

    def to_html(self, standalone: bool = False) -> str:
        """The picture as HTML: a fragment (for a notebook), or with ``standalone=True`` a whole
        page that opens offline (images as data: URIs, no script)."""
        body = f"<div class='ctv'>{self._body_html()}</div>"
        if standalone:
            return standalone_page(body, self.title or type(self).__name__)
        return f"<style>{PAGE_STYLE}</style>{body}"

    def to_png(self) -> bytes:
        return figure_bytes(self._figure(), "png")

    def to_svg(self) -> str:
        return figure_bytes(self._figure(), "svg").decode("utf-8")

    def _repr_html_(self) -> str:
        # HTML only: IPython computes every _repr_*_ a displayed object has, and a PNG drawing
        # (matplotlib) would cost each display a second or so for nothing; to_png() gives it.
        return self.to_html()

    def save(self, path: Union[str, Path]) -> Path:
        """Write to ``path``; the format follows its suffix: ``.html``, ``.png`` or ``.svg``."""
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix in (".html", ".htm"):
            path.write_text(self.to_html(standalone=True), encoding="utf-8")
        elif suffix == ".png":
            path.write_bytes(self.to_png())
        elif suffix == ".svg":
            path.write_text(self.to_svg(), encoding="utf-8")
        else:
            raise InputError(f"cannot save a {type(self).__name__} as {path.name!r}: expected a file name ending "
                             "in .html, .png or .svg.")
        return path
