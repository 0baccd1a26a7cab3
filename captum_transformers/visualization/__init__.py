"""Pictures of explanations, with one colour convention everywhere (``colors``: white at zero;
a signed method's map red for the explained class and blue against it on a scale symmetric
about zero; an unsigned method's map white to red, darker = more relevant, no direction; each
scale stated in a colour bar) and objects that show themselves in notebooks and ``save`` to
PNG, SVG or one self-contained HTML file (``output``). Signed or not follows the METHOD
(``signed=``, or the catalog's ``SIGNED_METHODS`` for catalog names), never the scale or data.

=====================  ==============================================================
image_overlay          one map over its image (opacity, patch grid, mask outline, boxes)
ExplanationGrid        methods x examples; ``report(model, inputs)`` computes it
TokenHeatmap           token colours; special tokens; word pieces merged (sum)
text_image_view        CLIP: text tokens beside the image overlay
text_regions_view      LXMERT / VisualBERT: text tokens, region strip, region boxes
detection_view         DETR: each explained detection's map and box
CurvePlot, curve_plots perturbation curves from results or a benchmark's results.json
GenerationMatrix       an LLM's generated tokens x the prompt and earlier output tokens
GenerationText         one generated token's evidence coloured over the text
generation_report      several methods' views of one generation side by side
GenerationImageView    a VLM's generated token: its image map beside its text evidence
=====================  ==============================================================

>>> from captum_transformers.visualization import report
>>> report(model, normalize(images), images=images, methods=["rollout", "attn-lrp"])  # doctest: +SKIP
"""
from .colors import ColorScale
from .curves import CurvePlot, curve_plots, plot_curves
from .generation import GenerationMatrix
from .generation_image import GenerationImageView
from .generation_text import GenerationReport, GenerationText, generation_report
from .grid import ExplanationGrid, report
from .images import ImageOverlay, image_overlay
from .streams import StreamView, detection_view, text_image_view, text_regions_view
from .tokens import TokenHeatmap, merge_word_pieces

__all__ = [
    "ColorScale", "CurvePlot", "curve_plots", "plot_curves", "ExplanationGrid", "report", "ImageOverlay",
    "image_overlay", "StreamView", "detection_view", "text_image_view", "text_regions_view", "TokenHeatmap",
    "merge_word_pieces", "GenerationMatrix", "GenerationText", "GenerationReport", "generation_report",
    "GenerationImageView",
]
