"""Helpers shared by the Chefer-method tests (tiny models from configs, no hub)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")
from timm.models.vision_transformer import VisionTransformer  # noqa: E402

from captum_transformers import AttnLRP, PartialLRP, RuleSet, TransformerLRP, TransformerRelevance  # noqa: E402
from hf_models import SMALL  # noqa: E402

F64 = torch.float64
OPERATION_PRESETS = [pytest.param(rules, id=rules.name) for rules in (RuleSet.CHEFER, RuleSet.LRP, RuleSet.ATTN_LRP)]
METHODS = [pytest.param(m, id=m.__name__) for m in (TransformerRelevance, PartialLRP, TransformerLRP, AttnLRP)]



# -- helpers ---------------------------------------------------------------------------------
def _lively(model: nn.Module, seed: int = 0, bias_std: float = 0.1) -> nn.Module:
    """Weights large enough for non-trivial attention (HF's N(0, 0.02) init makes the
    relevance-weighted maps ~1e-6 next to the identity of Eq. 13): matrices N(0, 0.2), 1-D
    weights (norms) 1 + N(0, 0.3), biases N(0, bias_std)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator).to(parameter.dtype)
            if "bias" in name.rsplit(".", 1)[-1]:
                parameter.copy_(noise * bias_std)
            elif parameter.dim() == 1:
                parameter.copy_(1 + 0.3 * noise)
            else:
                parameter.copy_(0.2 * noise)
    return model


def _hf_vit(dtype=F64, seed=0, bias_std=0.1, **config) -> nn.Module:
    torch.manual_seed(seed)
    model = transformers.ViTForImageClassification(transformers.ViTConfig(
        **SMALL, image_size=32, patch_size=8, num_labels=5, attn_implementation="eager", **config))
    return _lively(model.to(dtype).eval(), seed, bias_std)


def _timm_vit(dtype=F64, seed=0, bias_std=0.1) -> nn.Module:
    torch.manual_seed(seed)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, mlp_ratio=2,
                              num_classes=5)
    return _lively(model.to(dtype).eval(), seed, bias_std)


def _images(batch=3, seed=1, dtype=F64) -> torch.Tensor:
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _logits(output):
    return output.logits if hasattr(output, "logits") else output


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b|."""
    return float((a - b).abs().max() / b.abs().max())


class EncoderClassifier(nn.Module):
    """Embedding + nn.TransformerEncoder + head on token 0 (attention inside F.multi_head_attention_forward)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(23, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 5)

    def forward(self, ids, key_padding_mask=None):
        return self.head(self.encoder(self.embed(ids), src_key_padding_mask=key_padding_mask)[:, 0])


