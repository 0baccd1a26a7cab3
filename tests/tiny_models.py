"""Tiny user models shared by the guarantee tests (threads, compile, foreign patches, registry)."""
from __future__ import annotations

import torch
from torch import nn


class EncoderClassifier(nn.Module):
    """A user's nn.TransformerEncoder classifier in the configuration that takes PyTorch's fused
    fast path (batch first, even heads, eval, no grad) and nests padded batches; reads token 0."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(20, 16)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2)
        self.head = nn.Linear(16, 3)

    def forward(self, ids, key_padding_mask=None):
        return self.head(self.encoder(self.embed(ids), src_key_padding_mask=key_padding_mask)[:, 0])


def timm_vit_case():
    """A 2-layer timm ViT on 32 x 32 images: (model, inputs, forward kwargs)."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
    return model.eval(), torch.randn(3, 3, 32, 32), {}
