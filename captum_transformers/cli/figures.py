"""The pictures ``captum-transformers explain`` writes, drawn with ``captum_transformers.visualization``:
a methods x examples grid of overlays for images, signed token strips for text (red for the
explained class, blue against, white 0: negative relevance is not clamped away). Each is
written as ``explanations.png`` and as one self-contained ``explanations.html``."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import torch

from ..visualization import ExplanationGrid, TokenHeatmap


def image_grid(images: Sequence[torch.Tensor], maps: Dict[str, torch.Tensor], titles: Sequence[str],
               folder: Path) -> Tuple[Path, Path]:
    """One row per image: the image, then each method's (B, H, W) map over it (in grey), each
    map on its own colour scale (its range printed above it)."""
    # The 99th percentile of |map| as each map's limit: per-pixel maps (LRP, gradients) have
    # a few extreme pixels that would otherwise leave the rest white.
    grid = ExplanationGrid(images, maps, titles, scale="per-map", percentile=99.0,
                           title="captum-transformers explain")
    return grid.save(folder / "explanations.png"), grid.save(folder / "explanations.html")


def token_strips(tokens: List[List[str]], scores: Dict[str, torch.Tensor], titles: Sequence[str],
                 special_tokens, folder: Path) -> Tuple[Path, Path]:
    """For each example one line per method, every token coloured by its signed score, each line
    scaled by its largest |score| over the non-special tokens. ``scores`` are (B, longest)
    rows padded after each example's tokens."""
    lengths = torch.tensor([len(example) for example in tokens])
    mask = torch.arange(max(lengths)).unsqueeze(0) < lengths.unsqueeze(1)
    heatmap = TokenHeatmap(tokens, scores, titles=titles, special_tokens=special_tokens, attention_mask=mask,
                           title="captum-transformers explain")
    return heatmap.save(folder / "explanations.png"), heatmap.save(folder / "explanations.html")
