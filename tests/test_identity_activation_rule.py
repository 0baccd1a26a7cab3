"""ConservativeLRP's identity rule on element-wise activations (``activation_rule="identity"``).

Moved out of tests/test_conservative_lrp.py (section 9 there): relevance passes GELU and the
tanh pooler unchanged, so a bias-free BERT conserves exactly, and the default stays Ali et al.'s
plain gradient. Tiny float64 models from tests/lrp_models.py (random weights, no hub).
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from captum_transformers import ConservativeLRP, InputError  # noqa: E402
from lrp_models import (  # noqa: E402
    F64,
    _case_torch_mha,
    _random_biases,
    _random_norm_weights,
    _relative_errors,
    _text_inputs,
    _zero_biases,
)


def _bert_with_pooler(bias_std):
    """BertForSequenceClassification as the shipped MiniLM is built: GELU MLPs and the tanh pooler."""
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=99,
        num_labels=2, hidden_act="gelu", attn_implementation="eager")).to(F64).eval()
    model = _random_norm_weights(model)
    model = _zero_biases(model) if bias_std == 0 else _random_biases(model, bias_std)
    with torch.no_grad():
        model.classifier.weight.mul_(30)  # logits of order 0.3, not 0.01
    return model


def _relative_sum_errors(model, activation_rule):
    ids, mask = _text_inputs(batch=32, seq=8)
    logits = model(ids, attention_mask=mask).logits[:, 1].detach()
    relevance, delta = ConservativeLRP(model, activation_rule=activation_rule).attribute(
        ids, target=1, return_tokens=True, return_convergence_delta=True, forward_kwargs={"attention_mask": mask})
    return _relative_errors(relevance.sum(-1), logits), delta.abs() / logits.abs()


def test_identity_activation_rule_conserves_through_gelu_and_the_tanh_pooler():
    # Bias-free float64 BERT with GELU and the tanh pooler: AH+LN's plain gradient through GELU
    # and tanh does not conserve (measured median relative error 0.054, max 0.41); with the
    # identity rule on both the sum equals the logit (measured 6e-16 median, 3e-14 max).
    model = _bert_with_pooler(bias_std=0)
    default, _ = _relative_sum_errors(model, "gradient")
    identity, delta = _relative_sum_errors(model, "identity")
    assert identity.max() <= 1e-6 and delta.max() <= 1e-6, (identity, delta)
    assert default.median() > 1e-2, default
    # With biases nothing conserves exactly: biases absorb relevance. Measured, biases N(0, 0.02):
    # median relative error 0.049 (gradient) vs 0.10 (identity), worst 45 vs 41 (a logit near 0);
    # N(0, 0.1): 0.70 vs 0.77, worst 6.8 vs 6.5. The identity rule removes the activations'
    # share of the error, not the biases'.
    model = _bert_with_pooler(bias_std=0.02)
    default, _ = _relative_sum_errors(model, "gradient")
    identity, _ = _relative_sum_errors(model, "identity")
    assert identity.max() <= 1.1 * default.max(), (identity.max(), default.max())


def test_identity_activation_rule_is_an_option_and_the_default_keeps_ali_et_al():
    model, ids, kwargs, _ = _case_torch_mha()
    assert ConservativeLRP(model).activation_rule == "gradient"
    assert ConservativeLRP(model).rules.activation == "gradient"
    assert ConservativeLRP(model, activation_rule="identity").rules.activation == "identity"
    with pytest.raises(InputError, match="activation_rule"):
        ConservativeLRP(model, activation_rule="lrp0")
