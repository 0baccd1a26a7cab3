"""Pictures of explanations: image overlays, methods x examples grids, token heatmaps,
multi-stream views and perturbation curves, with one colour convention (``colors``: white
at zero, red for, blue against) and objects that show themselves in notebooks and save to
PNG, SVG or one self-contained HTML file (``output``)."""
from .colors import ColorScale
from .grid import ExplanationGrid, report
from .images import ImageOverlay, image_overlay
from .tokens import TokenHeatmap, merge_word_pieces

__all__ = ["ColorScale", "ExplanationGrid", "ImageOverlay", "image_overlay", "report", "TokenHeatmap", "merge_word_pieces"]
