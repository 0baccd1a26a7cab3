"""The models and batches of ``attention_methods.py``: HF ViT and BERT (the default pair),
and the same sizes as a timm ViT and as an ``nn.TransformerEncoder`` classifier, all built
from configs with random weights (no hub access)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

MODELS = ("vit", "bert")
# Also available with --models: the same sizes as a timm ViT and as a pre-norm nn.TransformerEncoder.
EXTRA_MODELS = ("timm_vit", "mha_encoder")
IMAGE_MODELS = ("vit", "timm_vit")


@dataclasses.dataclass(frozen=True)
class Sizes:
    layers: int = 6
    hidden: int = 256
    heads: int = 4
    intermediate: int = 1024
    image: int = 224
    patch: int = 16
    seq_len: int = 128
    batch: int = 16
    vocab: int = 30522
    vit_labels: int = 1000
    bert_labels: int = 2


FULL = Sizes()
QUICK = Sizes(layers=2, hidden=32, heads=2, intermediate=64, image=32, patch=8, seq_len=16, batch=2, vocab=100,
              vit_labels=5, bert_labels=3)


# --------------------------------------------------------------------------- models


def build_model(name: str, sizes: Sizes, device: str = "cpu", attn_implementation: Optional[str] = None,
                seed: int = 0) -> torch.nn.Module:
    """A randomly initialised HF ``ViTForImageClassification`` or ``BertForSequenceClassification``
    (or, for ``EXTRA_MODELS``, a timm ViT or an ``nn.TransformerEncoder`` classifier)."""
    torch.manual_seed(seed)
    if name == "timm_vit":
        import timm

        return timm.create_model("vit_base_patch16_224", pretrained=False, depth=sizes.layers, embed_dim=sizes.hidden,
                                 num_heads=sizes.heads, mlp_ratio=sizes.intermediate / sizes.hidden,
                                 img_size=sizes.image, patch_size=sizes.patch,
                                 num_classes=sizes.vit_labels).to(device).eval()
    if name == "mha_encoder":
        return EncoderClassifier(sizes).to(device).eval()
    from transformers import BertConfig, BertForSequenceClassification, ViTConfig, ViTForImageClassification

    common = dict(hidden_size=sizes.hidden, num_hidden_layers=sizes.layers, num_attention_heads=sizes.heads,
                  intermediate_size=sizes.intermediate)
    if attn_implementation is not None:
        common["attn_implementation"] = attn_implementation
    if name == "vit":
        model = ViTForImageClassification(ViTConfig(**common, image_size=sizes.image, patch_size=sizes.patch,
                                                    num_labels=sizes.vit_labels))
    elif name == "bert":
        model = BertForSequenceClassification(BertConfig(**common, vocab_size=sizes.vocab,
                                                         max_position_embeddings=max(512, sizes.seq_len),
                                                         num_labels=sizes.bert_labels))
    else:
        raise ValueError(f"unknown model {name!r}; use one of {MODELS + EXTRA_MODELS}")
    return model.to(device).eval()


class EncoderClassifier(torch.nn.Module):
    """Token embeddings, a pre-norm ``nn.TransformerEncoder`` (GELU, no dropout) and a head on
    the first token: the ``nn.MultiheadAttention`` model of the benchmark."""

    def __init__(self, sizes: Sizes):
        super().__init__()
        self.embed = torch.nn.Embedding(sizes.vocab, sizes.hidden)
        layer = torch.nn.TransformerEncoderLayer(sizes.hidden, sizes.heads, sizes.intermediate, dropout=0.0,
                                                 activation="gelu", batch_first=True, norm_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, sizes.layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(sizes.hidden, sizes.bert_labels)

    def forward(self, input_ids, key_padding_mask=None):
        return self.head(self.encoder(self.embed(input_ids), src_key_padding_mask=key_padding_mask)[:, 0])


@dataclasses.dataclass
class Batch:
    inputs: torch.Tensor  # pixel values or input ids
    forward_kwargs: dict
    target: torch.Tensor  # (B,) class per example


def make_batch(name: str, sizes: Sizes, device: str = "cpu", seed: int = 1) -> Batch:
    """Random pixels, or random token ids with every odd example padded over its last quarter."""
    generator = torch.Generator().manual_seed(seed)
    labels = sizes.vit_labels if name in IMAGE_MODELS else sizes.bert_labels
    target = (torch.arange(sizes.batch) % labels).to(device)
    if name in IMAGE_MODELS:
        pixels = torch.randn(sizes.batch, 3, sizes.image, sizes.image, generator=generator)
        return Batch(pixels.to(device), {}, target)
    ids = torch.randint(5, sizes.vocab, (sizes.batch, sizes.seq_len), generator=generator)
    mask = torch.ones(sizes.batch, sizes.seq_len, dtype=torch.long)
    mask[1::2, sizes.seq_len - sizes.seq_len // 4:] = 0
    if name == "mha_encoder":
        return Batch(ids.to(device), {"key_padding_mask": (mask == 0).to(device)}, target)
    return Batch(ids.to(device), {"attention_mask": mask.to(device)}, target)


def _logits(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output
