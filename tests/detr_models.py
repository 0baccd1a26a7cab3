"""A tiny DETR object detector built from configs (random weights, offline, no hub).

A two-stage ResNet backbone (stride 8: a 64x48 image gives an 8x6 feature grid), a
2+2-layer Transformer of width 32 with 4 heads, 5 object queries and 3 classes (+ "no
object"). ``init_std=0.5`` spreads the random weights so that queries differ from each
other (with the default 0.02 every query gives the same logits to 4 decimals).
"""
from __future__ import annotations

from typing import Optional

import pytest
import torch

transformers = pytest.importorskip("transformers")

NUM_QUERIES = 5
NUM_LABELS = 3
STRIDE = 8


def detr(attn_implementation: Optional[str] = "eager", seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    """The detector; ``attn_implementation=None`` lets transformers choose (sdpa for the
    Transformer; naming "sdpa" fails, as the ResNet backbone does not support it)."""
    backbone = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                         layer_type="basic", out_features=["stage2"])
    config = transformers.DetrConfig(
        backbone_config=backbone, use_pretrained_backbone=False, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        num_queries=NUM_QUERIES, num_labels=NUM_LABELS, dropout=0.0, init_std=0.5,
        **({} if attn_implementation is None else {"attn_implementation": attn_implementation}),
    )
    torch.manual_seed(seed)
    return transformers.DetrForObjectDetection(config).to(dtype).eval()


def images(batch: int = 2, height: int = 64, width: int = 48, seed: int = 1, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(batch, 3, height, width, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def padded_mask(batch: int = 2, height: int = 64, width: int = 48) -> torch.Tensor:
    """pixel_mask (B, H, W): example 1 is an image of 40x32 padded at the bottom and right."""
    mask = torch.ones(batch, height, width, dtype=torch.long)
    if batch > 1:
        mask[1, 40:] = 0
        mask[1, :, 32:] = 0
    return mask
