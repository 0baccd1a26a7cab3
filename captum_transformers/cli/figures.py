"""The pictures ``captum-transformers explain`` writes, drawn with ``captum_transformers.visualization``:
a methods x examples grid of overlays for images, token strips for text (signed maps: red for
the explained class, blue against, white 0, negative relevance not clamped away; unsigned
maps: darker = more relevant, no direction). Each is written as ``explanations.png`` and as
one self-contained ``explanations.html``.

The picture tells a recommended method from a baseline by itself: the papers' methods come
first, then the baselines, each titled ``name (baseline)`` (``(Captum baseline)`` for
Captum's own), so a newcomer does not read TransformerLRP's or Saliency's map as one of the
methods the package recommends."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..methods.catalog import CAPTUM_BASELINES, KNOWN_METHOD_NAMES, SIGNED_METHODS
from ..visualization import ExplanationGrid, TokenHeatmap

# The baselines of the papers' tables (Chefer et al. 2021a/b, Ali et al. 2022): shown for
# comparison, not recommended (README, "Which method when"). Captum's own methods are the
# baselines users compare against. Every other catalog method is one of the papers' methods.
PAPER_BASELINES = frozenset({"raw-attention", "grad-cam", "partial-lrp", "lrp", "gradient-x-input",
                             "conservative-lrp-ah"})


def column_title(name: str) -> str:
    """The title a method's maps get in the picture: its name, marked when it is a baseline."""
    if name in PAPER_BASELINES:
        return f"{name} (baseline)"
    if name in CAPTUM_BASELINES:
        return f"{name} (Captum baseline)"
    return name


def recommended_first(maps: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``maps`` with the papers' methods first and the baselines after them (each group in the
    given order), keyed by :func:`column_title`."""
    def is_baseline(name: str) -> bool:
        return name in PAPER_BASELINES or name in CAPTUM_BASELINES

    ordered = [name for name in maps if not is_baseline(name)] + [name for name in maps if is_baseline(name)]
    return {column_title(name): maps[name] for name in ordered}


def signedness(names) -> Dict[str, bool]:
    """``{column title: signed}`` of the catalog methods among ``names``: each map is labelled by
    its METHOD (``SIGNED_METHODS``), not by its values (a signed map may hold no negative value)
    nor by its title (``lrp (baseline)`` is no catalog name)."""
    return {column_title(name): name in SIGNED_METHODS for name in names if name in KNOWN_METHOD_NAMES}


def image_grid(images: Sequence[torch.Tensor], maps: Dict[str, torch.Tensor], titles: Sequence[str],
               folder: Path, logits: Optional[torch.Tensor] = None) -> Tuple[Path, Path]:
    """One row per image: the image, then each method's (B, H, W) map over it (in grey), each
    map on its own colour scale (its range printed above it); baselines last, marked. With
    ``logits`` (the explained logit per image) each signed map shows its sum next to it."""
    # The 99th percentile of |map| as each map's limit: per-pixel maps (LRP, gradients) have
    # a few extreme pixels that would otherwise leave the rest white.
    grid = ExplanationGrid(images, recommended_first(maps), titles, scale="per-map", percentile=99.0,
                           title="captum-transformers explain (baselines last, marked '(baseline)')", logits=logits,
                           signed=signedness(maps))
    return grid.save(folder / "explanations.png"), grid.save(folder / "explanations.html")


def token_strips(tokens: List[List[str]], scores: Dict[str, torch.Tensor], titles: Sequence[str],
                 special_tokens, folder: Path, logits: Optional[torch.Tensor] = None) -> Tuple[Path, Path]:
    """For each example one line per method (baselines last, marked), every token coloured by
    its score, each line scaled by its largest |score| over the non-special tokens. ``scores``
    are (B, longest) rows padded after each example's tokens; ``logits`` as in :func:`image_grid`."""
    lengths = torch.tensor([len(example) for example in tokens])
    mask = torch.arange(max(lengths)).unsqueeze(0) < lengths.unsqueeze(1)
    heatmap = TokenHeatmap(tokens, recommended_first(scores), titles=titles, special_tokens=special_tokens,
                           attention_mask=mask, title="captum-transformers explain (baselines last, marked)",
                           logits=logits, signed=signedness(scores))
    return heatmap.save(folder / "explanations.png"), heatmap.save(folder / "explanations.html")
