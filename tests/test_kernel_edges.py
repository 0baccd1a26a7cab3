"""Edges of the memory-saving kernels, found in review.

1. The alpha-beta linear rule over several row chunks equals the rule over all rows at
   once (both rule variants, and ``addmm`` with a bias that has one row per example).
2. An HF attention computed outside the autograd graph is refused with a CaptureError
   (the kernel reports no gradient for it), not silently given a zero gradient.
3. ``softmax_attention`` never writes into a tensor of the caller, even when the scores
   function returns one of its inputs.
"""
from __future__ import annotations

import pytest
import torch

from captum_transformers import CaptureError, GenericAttention, RuleSet
from captum_transformers import linear_rule
from captum_transformers.attention_core import softmax_attention
from captum_transformers.operation_rules import OperationRules
from hf_models import CASES


def _linear_layer(func):
    """A linear layer's output (``F.linear``, or ``addmm(M, x, W^T)`` with M holding one bias
    row per input row), its input and an output seed, in float64."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 6, generator=generator, dtype=torch.float64).requires_grad_()
    weight = torch.randn(5, 6, generator=generator, dtype=torch.float64)
    bias = torch.randn(5, generator=generator, dtype=torch.float64)
    row_bias = torch.randn(18, 5, generator=generator, dtype=torch.float64)

    def output():
        if func == "linear":
            return torch.nn.functional.linear(x, weight, bias)
        return torch.addmm(row_bias, x.reshape(18, 6), weight.t())

    return output, x


def _gradient(func, rules=None):
    output, x = _linear_layer(func)
    if rules is None:
        y = output()
    else:
        with OperationRules(rules, 2):
            y = output()
    seed = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)
    return torch.autograd.grad(y, x, seed)[0]


@pytest.mark.parametrize("rules", [RuleSet.CHEFER, RuleSet.LRP], ids=lambda r: r.name)
@pytest.mark.parametrize("func", ["linear", "addmm"])
def test_linear_rule_in_row_chunks_equals_all_rows(monkeypatch, rules, func):
    whole = _gradient(func, rules)
    monkeypatch.setattr(linear_rule, "_CHUNK_ELEMENTS", 12)  # 2 rows per chunk: 9 chunks
    chunked = _gradient(func, rules)
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=1e-14)
    assert whole.abs().max() > 1e-3
    assert not torch.allclose(_gradient(func), whole)  # the rule is not the gradient: the check can fail


def test_hf_attention_outside_the_graph_is_refused():
    case = CASES["bert"]
    model = case.model()
    inputs, kwargs = case.inputs()
    layer = model.bert.encoder.layer[0].attention.self

    def no_grad_forward(original):
        def forward(*args, **kw):
            with torch.no_grad():
                return original(*args, **kw)
        return forward

    layer.forward = no_grad_forward(layer.forward)
    try:
        with pytest.raises(CaptureError, match="does not require grad"):
            GenericAttention(model).attribute(inputs, target=0, forward_kwargs=kwargs)
    finally:
        del layer.forward


def test_softmax_attention_leaves_the_callers_tensors_alone():
    generator = torch.Generator().manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=generator).requires_grad_()  # noqa: E731
    query, key, value, given_scores = make(1, 2, 3, 4), make(1, 2, 3, 4), make(1, 2, 3, 4), make(1, 2, 3, 3)
    before = given_scores.detach().clone()
    with OperationRules(RuleSet.CHEFER, 1):
        output, _ = softmax_attention(lambda q, k, scores: scores, query, key, value, given_scores)
    output.sum().backward()
    assert torch.equal(given_scores.detach(), before)
    assert given_scores.grad is not None and given_scores.grad.abs().max() > 0
