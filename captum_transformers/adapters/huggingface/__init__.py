"""HuggingFace transformers models: the adapter, its explicit attention kernel (and replay, row
chunks, kernel keys), kept logits, position padding, and the families with their own seams (inline
attention, DETR, Swin).
"""
from .adapter import HuggingFaceAdapter
from .detr import DetrAdapter
from .inline_attention import InlineAttentionAdapter
from .swin import SwinAdapter, Swinv2Adapter

__all__ = ["HuggingFaceAdapter", "DetrAdapter", "InlineAttentionAdapter", "SwinAdapter", "Swinv2Adapter"]
