"""A bridge for Captum Insights users: the same classes and arguments, served by this
package's explorer (Captum Insights was retired after Captum 0.8.0).

    from captum_transformers.integrations.insights import AttributionVisualizer, Batch
    from captum_transformers.integrations.insights.features import ImageFeature, TextFeature, GeneralFeature
"""
from . import features
from .features import GeneralFeature, ImageFeature, TextFeature
from .visualizer import AttributionVisualizer, Batch

__all__ = ["AttributionVisualizer", "Batch", "features", "ImageFeature", "TextFeature", "GeneralFeature"]
