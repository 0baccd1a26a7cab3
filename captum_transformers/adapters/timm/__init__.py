"""timm models: Vision Transformers (ViT, DeiT, EVA) and Swin, through attention hooks.
"""
from .vit import TimmAdapter
from .swin import TimmSwinAdapter

__all__ = ["TimmAdapter", "TimmSwinAdapter"]
