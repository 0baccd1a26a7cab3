"""PNG figures of explanations: an image grid, or token heat strips for text."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Sequence

import torch

from ..errors import InputError


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("figures need matplotlib: pip install 'captum_transformers[viz]'.") from None
    return plt


def image_grid(images: Sequence[torch.Tensor], maps: Dict[str, torch.Tensor], titles: Sequence[str],
               path: Path) -> Path:
    """One row per image: the image, then each method's map (B, H, W) as a heat map (a
    diverging map centred at 0 for signed relevance)."""
    plt = _pyplot()
    rows, cols = len(images), len(maps) + 1
    figure, axes = plt.subplots(rows, cols, figsize=(1.7 * cols, 1.8 * rows), squeeze=False)
    for row, image in enumerate(images):
        axes[row][0].imshow(image.permute(1, 2, 0).clamp(0, 1).numpy(), interpolation="nearest")
        axes[row][0].set_title(titles[row], fontsize=7)
        for col, (name, batch_maps) in enumerate(maps.items(), start=1):
            heat = batch_maps[row]
            if bool((heat < 0).any()):  # signed relevance: red positive, blue negative, white zero
                limit = float(heat.abs().max()) or 1.0
                axes[row][col].imshow(heat.numpy(), cmap="bwr", vmin=-limit, vmax=limit, interpolation="nearest")
            else:
                axes[row][col].imshow(heat.numpy(), cmap="inferno", interpolation="nearest")
            if row == 0:
                axes[row][col].set_title(name, fontsize=7)
    for axis in (a for line in axes for a in line):
        axis.axis("off")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def token_strips(tokens: List[List[str]], scores: Dict[str, torch.Tensor], titles: Sequence[str],
                 path: Path) -> Path:
    """For each example, one line per method with every token shaded by its positive score
    (divided by the line's maximum), in a monospace font so that positions follow characters."""
    plt = _pyplot()
    label_chars = max(len(name) for name in scores) + 2
    line_chars = label_chars + max(sum(len(token) + 1 for token in example) for example in tokens)
    lines = len(tokens) * (len(scores) + 1)
    figure = plt.figure(figsize=(min(0.075 * line_chars + 0.5, 40), 0.28 * lines + 0.3))
    axis = figure.add_axes((0, 0, 1, 1))
    axis.axis("off")
    colormap = plt.get_cmap("Reds")
    char = 1.0 / line_chars
    step = 1.0 / lines
    y = 1.0 - step / 2
    for example, example_tokens in enumerate(tokens):
        axis.text(0, y, titles[example], fontsize=8, weight="bold", va="center", family="monospace")
        y -= step
        for name, method_scores in scores.items():
            values = method_scores[example, :len(example_tokens)].clamp(min=0)
            values = values / values.max().clamp(min=1e-12)
            axis.text(0, y, name, fontsize=7, va="center", family="monospace")
            x = label_chars * char
            for token, value in zip(example_tokens, values.tolist()):
                axis.text(x, y, token, fontsize=7, va="center", family="monospace",
                          bbox=dict(facecolor=colormap(0.85 * value), edgecolor="none", pad=0.5))
                x += (len(token) + 1) * char
            y -= step
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
