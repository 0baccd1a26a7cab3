"""Curve plots live in ``captum_transformers.visualization.curves``; ``plot_curves`` here calls
that one, so ``from captum_transformers.evaluation import plot_curves`` keeps working.
(Imported on first call: ``visualization.curves`` reads this package's result records.)"""
from __future__ import annotations

from typing import Optional


def plot_curves(curves, path, title: Optional[str] = None, dpi: int = 120) -> None:
    """See ``captum_transformers.visualization.curves.plot_curves``: ``{method: CurveResult}``
    drawn on one axis and written to ``path`` (format from its suffix)."""
    from ..visualization.curves import plot_curves as draw

    draw(curves, path, title=title, dpi=dpi)
