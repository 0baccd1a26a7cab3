"""Relevance propagation through the inline-attention adapter (LXMERT, VisualBERT): forward
bit-identical under every rule set, AH+LN conservation on bias-free models (VisualBERT's one
stream; LXMERT at the inputs and per stream at the tokens), streams kept apart."""
from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from captum_transformers import ConservativeLRP, get_adapter  # noqa: E402
from inline_models import B, CASES, I, PRESETS, T, VIS, lxmert, regions, text  # noqa: E402


@pytest.mark.parametrize("rules", PRESETS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_bit_identical_under_every_rule_set(case, rules):
    model, inputs, kwargs = CASES[case](True)
    field = "question_answering_score" if case == "lxmert" else "logits"
    with torch.enable_grad():
        plain = getattr(model(*inputs, **kwargs), field)
        with get_adapter(model).propagation(model, rules):
            ruled = getattr(model(*inputs, **kwargs), field)
    assert torch.equal(plain, ruled)


def _bias_free(model):
    """float64, ReLU (set in the config), no biases, norm weights away from 1."""
    from lrp_models import _random_norm_weights, _zero_biases

    return _random_norm_weights(_zero_biases(model.double()))


class VisualBertCLS(nn.Module):
    """VisualBertModel without its tanh pooler: a bias-free linear head on CLS."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        config = transformers.VisualBertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                               intermediate_size=64, visual_embedding_dim=VIS, vocab_size=50,
                                               hidden_act="relu")
        self.body = transformers.VisualBertModel(config, add_pooling_layer=False)
        self.head = nn.Linear(32, 3, bias=False)

    def forward(self, input_ids, attention_mask=None, visual_embeds=None):
        hidden = self.body(input_ids, attention_mask=attention_mask, visual_embeds=visual_embeds).last_hidden_state
        return self.head(hidden[:, 0])


class LxmertCLS(nn.Module):
    """LxmertModel on text embeddings (position and segment embeddings zeroed: they act as a
    bias) with a bias-free linear head on the text CLS, instead of the tanh pooler."""

    def __init__(self):
        super().__init__()
        self.body = lxmert(transformers.LxmertModel, hidden_act="relu")
        with torch.no_grad():
            self.body.embeddings.position_embeddings.weight.zero_()
            self.body.embeddings.token_type_embeddings.weight.zero_()
        self.head = nn.Linear(32, 3, bias=False)

    def forward(self, text_embeds, visual_feats, visual_pos, attention_mask=None):
        out = self.body(inputs_embeds=text_embeds, visual_feats=visual_feats, visual_pos=visual_pos,
                        attention_mask=attention_mask)
        return self.head(out.language_output[:, 0])


def test_ah_ln_conserves_on_bias_free_visual_bert_and_gi_does_not():
    torch.manual_seed(0)
    model = _bias_free(VisualBertCLS().eval())
    ids, mask = text()
    kwargs = {"attention_mask": mask, "visual_embeds": torch.randn(B, I, VIS, dtype=torch.float64)}
    logits = model(ids, **kwargs)[:, 1].detach()
    errors = {}
    for variant in ("AH+LN", "GI"):
        relevance = ConservativeLRP(model, variant).attribute(ids, target=1, return_tokens=True,
                                                              forward_kwargs=kwargs)
        assert relevance.shape == (B, T + I)
        errors[variant] = ((relevance.sum(-1) - logits).abs() / logits.abs()).max()
    assert errors["AH+LN"] <= 1e-6, errors  # measured ~1e-15
    assert errors["GI"] > 0.1, errors


def _bias_free_lxmert_case():
    """The bias-free LXMERT, its float64 inputs (text as embeddings) and the logits of class 1."""
    torch.manual_seed(0)
    model = _bias_free(LxmertCLS().eval())
    generator = torch.Generator().manual_seed(3)
    embeds = torch.randn(B, T, 32, generator=generator, dtype=torch.float64)
    feats, pos = (t.double() for t in regions())
    _, mask = text()
    logits = model(embeds, feats, pos, attention_mask=mask)[:, 1].detach()
    return model, embeds, feats, pos, mask, logits


def test_ah_ln_conserves_on_bias_free_lxmert_at_the_inputs_and_gi_does_not():
    model, embeds, feats, pos, mask, logits = _bias_free_lxmert_case()
    errors = {}
    for variant in ("AH+LN", "GI"):
        relevance = ConservativeLRP(model, variant, relevance_at="inputs").attribute(
            (embeds, feats, pos), target=1, forward_kwargs={"attention_mask": mask})
        total = sum(r.sum((1, 2)) for r in relevance)
        errors[variant] = ((total - logits).abs() / logits.abs()).max()
    assert errors["AH+LN"] <= 1e-6, errors
    assert errors["GI"] > 0.1, errors


def test_lxmert_token_relevance_is_read_per_stream_and_conserves_over_both():
    """Token relevance is read at the first layer of each stream (text: the first language
    layer; image: the first relational layer), mapped onto that stream's inputs only."""
    model, embeds, feats, pos, mask, logits = _bias_free_lxmert_case()
    explainer = ConservativeLRP(model, "AH+LN", relevance_at="tokens")
    kwargs = {"attention_mask": mask}
    text_tokens, image_tokens = explainer.attribute((embeds, feats, pos), target=1, return_tokens=True,
                                                    forward_kwargs=kwargs)
    assert text_tokens.shape == (B, T) and image_tokens.shape == (B, I)
    assert torch.all(text_tokens[1, 3:] == 0)  # padding
    total = text_tokens.sum(-1) + image_tokens.sum(-1)
    assert ((total - logits).abs() / logits.abs()).max() <= 1e-6
    assert image_tokens.abs().sum() > 0.05 * total.abs().sum()  # the image stream carries relevance
    on_embeds, on_feats, on_pos = explainer.attribute((embeds, feats, pos), target=1, forward_kwargs=kwargs)
    torch.testing.assert_close(on_embeds[..., 0], text_tokens)
    torch.testing.assert_close(on_feats[..., 0], image_tokens)
    assert torch.count_nonzero(on_pos) == 0


def test_lxmert_relevance_with_as_many_regions_as_tokens_keeps_the_streams_apart():
    model = lxmert()
    ids, mask = text(padded=False)
    feats, pos = regions()
    feats, pos = feats[:, :T - 1], pos[:, :T - 1]  # as many regions as text tokens
    ids = ids[:, :T - 1]
    on_ids, on_feats, _ = ConservativeLRP(model, "AH+LN").attribute((ids, feats, pos), target=0)
    assert not torch.allclose(on_ids, on_feats[..., 0])
