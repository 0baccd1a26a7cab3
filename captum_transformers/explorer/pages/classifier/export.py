"""The explorer's view as one self-contained HTML file (no script, no network): the methods x
examples grid with each map drawn over its image as an inline PNG, or tokens coloured by score.

Colours are the page's: a signed diverging map, scaled per map by ``max |m|`` (blue negative,
white 0, red positive), blended over the image at ``OVERLAY_ALPHA``. Every string (class names,
tokens, method names) is HTML-escaped. The file renders offline and inline in notebooks
(``insights.AttributionVisualizer.render`` returns it).

Example::

    >>> html = explorer_html(workspace, {"rollout": workspace.explain("rollout", {}, {0: 3})}, {0: 3})
    >>> open("view.html", "w").write(html)
"""
from __future__ import annotations

import base64
import html
import struct
import zlib
from typing import Any, Dict, Mapping

import torch

from ....methods.catalog import SIGNED_METHODS

OVERLAY_ALPHA = 0.6
CELL_PIXELS = 128


def png_bytes(rgb: torch.Tensor) -> bytes:
    """A (H, W, 3) uint8 tensor as PNG file bytes (8-bit RGB, no filtering, zlib level 6)."""
    height, width, _ = rgb.shape
    rows = torch.cat([torch.zeros(height, 1, dtype=torch.uint8), rgb.reshape(height, width * 3)], dim=1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows.numpy().tobytes(), 6))
            + chunk(b"IEND", b""))


def diverging(values: torch.Tensor) -> torch.Tensor:
    """Signed scores (any shape) to RGB in [0, 1] (shape + (3,)): -max -> blue, 0 -> white, +max -> red."""
    scale = values.abs().max()
    t = values / scale if scale > 0 else torch.zeros_like(values)
    positive, negative = t.clamp(min=0), (-t).clamp(min=0)
    red = 1 - negative * 0.8
    green = 1 - (positive + negative) * 0.8
    blue = 1 - positive * 0.8
    return torch.stack([red, green, blue], dim=-1).clamp(0, 1)


def overlay(image01: torch.Tensor, scores: torch.Tensor, size: int = CELL_PIXELS) -> torch.Tensor:
    """Map over image as (size, size, 3) uint8: the image (nearest-upscaled) blended with
    ``diverging(scores)`` (upscaled the same way) at ``OVERLAY_ALPHA``."""
    image = torch.nn.functional.interpolate(image01[None].float(), size=(size, size), mode="nearest")[0]
    heat = torch.nn.functional.interpolate(scores[None, None].float(), size=(size, size), mode="nearest")[0, 0]
    blended = (1 - OVERLAY_ALPHA) * image.permute(1, 2, 0) + OVERLAY_ALPHA * diverging(heat)
    return (blended.clamp(0, 1) * 255).round().to(torch.uint8)


def _image_tag(rgb: torch.Tensor, alt: str) -> str:
    data = base64.b64encode(png_bytes(rgb)).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{html.escape(alt)}" width="{CELL_PIXELS}">'


def _tokens_html(tokens, scores) -> str:
    colours = diverging(torch.as_tensor(scores, dtype=torch.float32))
    spans = []
    for token, colour, score in zip(tokens, colours.tolist(), scores):
        rgb = ",".join(str(round(c * 255)) for c in colour)
        spans.append(f'<span title="{score:.4g}" style="background:rgb({rgb});padding:1px 2px;margin:1px">'
                     f'{html.escape(str(token))}</span>')
    return "".join(spans)


def explorer_html(workspace, maps: Mapping[str, Mapping[int, Dict[str, Any]]], targets: Mapping[int, int]) -> str:
    """The grid of ``maps[method][example]`` as one HTML document (see the module docstring)."""
    examples = list(targets)
    predictions = {p.index: p for p in workspace.predictions()}
    names = workspace.class_names
    head = ["<th>method</th>"]
    for index in examples:
        p = predictions[index]
        label = f", true {'+'.join(names[v] for v in p.labels)}" if p.labels else ""
        caption = f"#{index}: pred {names[p.predicted]} ({p.probability:.2f}){label}; explains {names[targets[index]]}"
        head.append(f"<th>{html.escape(caption)}</th>")
    rows = []
    if workspace.modality == "image":
        originals = ["<td>input</td>"]
        for index in examples:
            image = torch.as_tensor(workspace.displays[index]).float()
            big = torch.nn.functional.interpolate(image[None], size=(CELL_PIXELS, CELL_PIXELS), mode="nearest")[0]
            rgb = (big.clamp(0, 1).permute(1, 2, 0) * 255).round().to(torch.uint8)
            originals.append(f"<td>{_image_tag(rgb, f'example {index}')}</td>")
        rows.append("<tr>" + "".join(originals) + "</tr>")
    for method, by_example in maps.items():
        sign_note = ("signed: red for, blue against" if method in SIGNED_METHODS
                     else "unsigned: darker = more relevant, no direction")
        cells = [f"<td>{html.escape(method)}<br><small>{sign_note}</small></td>"]
        for index in examples:
            found = by_example[index]
            scores = torch.tensor(found["values"], dtype=torch.float32).reshape(found["shape"])
            if found.get("all_zero"):
                cells.append("<td>all scores 0: nothing to draw</td>")
            elif workspace.modality == "image":
                image = torch.as_tensor(workspace.displays[index]).float()
                cells.append(f"<td>{_image_tag(overlay(image, scores), f'{method} on example {index}')}</td>")
            else:
                cells.append(f"<td>{_tokens_html(workspace.displays[index], scores.tolist())}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    title = html.escape(f"captum_transformers explorer: {workspace.name}")
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>" + title + "</title></head><body>"
            f"<h3>{title}</h3><p>Signed methods: red = relevance for the explained class, blue = against it. "
            "Unsigned methods (every other, each marked under its name): darker red = more relevant, with no "
            "direction. Each map scaled by its largest absolute value.</p><table style=\"border-collapse:collapse;font:12px sans-serif\">"
            "<tr>" + "".join(head) + "</tr>" + "".join(rows) + "</table></body></html>")
