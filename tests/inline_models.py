"""Tiny LXMERT and VisualBERT models built from configs (random weights, offline, no hub),
with their inputs: text example 1 is padded after 3 tokens; 5 text tokens and 4 image
regions, so a swapped stream pair cannot fit."""
from __future__ import annotations

import pytest
import torch

from captum_transformers import CaptureSpec, RuleSet

transformers = pytest.importorskip("transformers")

T, I, B = 5, 4, 3  # text tokens, image regions (different, so a swapped stream pair cannot fit), batch
FEAT, POS, VIS = 6, 4, 8
L_LAYERS, X_LAYERS, R_LAYERS = 2, 2, 1
KEEP = CaptureSpec(forward_reduce=lambda probs: probs)
PRESETS = [pytest.param(r, id=r.name) for r in (RuleSet.GRADIENT, RuleSet.AH, RuleSet.AH_LN, RuleSet.CHEFER,
                                               RuleSet.LRP, RuleSet.ATTN_LRP)]


def lxmert(cls=None, seed=0, **config):
    torch.manual_seed(seed)
    settings = dict(hidden_size=32, num_attention_heads=4, intermediate_size=64, l_layers=L_LAYERS,
                    x_layers=X_LAYERS, r_layers=R_LAYERS, visual_feat_dim=FEAT, visual_pos_dim=POS, vocab_size=50,
                    num_qa_labels=3)
    settings.update(config)
    return (cls or transformers.LxmertForQuestionAnswering)(transformers.LxmertConfig(**settings)).eval()


def visual_bert(cls=None, seed=0, **config):
    torch.manual_seed(seed)
    settings = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                    visual_embedding_dim=VIS, vocab_size=50, num_labels=3)
    settings.update(config)
    return (cls or transformers.VisualBertForVisualReasoning)(transformers.VisualBertConfig(**settings)).eval()


def text(batch=B, padded=True, seed=1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 50, (batch, T), generator=generator)
    mask = torch.ones(batch, T, dtype=torch.long)
    if padded and batch > 1:
        mask[1, 3:] = 0
    return ids, mask


def regions(batch=B, seed=2, dim=FEAT):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, I, dim, generator=generator), torch.rand(batch, I, POS, generator=generator)


def _lxmert_case(padded):
    ids, mask = text(padded=padded)
    feats, pos = regions()
    return lxmert(), (ids, feats, pos), {"attention_mask": mask}


def _visual_bert_case(padded):
    ids, mask = text(padded=padded)
    return visual_bert(), (ids,), {"attention_mask": mask, "visual_embeds": torch.randn(B, I, VIS)}


CASES = {"lxmert": _lxmert_case, "visual_bert": _visual_bert_case}
