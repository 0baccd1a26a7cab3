"""The linear rules' backward recomputes the layer's output instead of keeping it.

``R_y = y * g_y`` needs the layer's output ``y``; holding it from the forward to the backward
pass costs one activation per linear layer (about 4 % of TransformerRelevance's peak on a 2k-token
Llama, measured in benchmarks/long_context.py: 1.49x -> 1.43x the plain forward + backward). The
rule recomputes ``y = x W^T + b`` per chunk of rows. Checked against the rules written from
their definitions (Chefer et al., CVPR 2021, Eq. 5: alpha=1, beta=0 with one denominator; LRP-gamma,
Montavon et al. 2019) with the saved output, in float64, with several chunks and per-example biases.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from captum_transformers.propagation.rules import linear as lr
from captum_transformers.propagation.rules.rule_set import RuleSet

F64 = torch.float64


def _alpha1beta0(x, weight, bias, grad):
    """Eq. 5 from the paper: R_j = sum_i (x+_j W+_ij + x-_j W-_ij) / z+_i R_i, in g x input form."""
    output = x @ weight.t() + bias
    relevance = output * grad
    w_pos, w_neg = weight.clamp(min=0), weight.clamp(max=0)
    x_pos, x_neg = x.clamp(min=0), x.clamp(max=0)
    z = x_pos @ w_pos.t() + x_neg @ w_neg.t()
    s = torch.where(z != 0, relevance / (z + 1e-9 * z.sign()), torch.zeros_like(z))  # z = 0 passes nothing
    contribution = x_pos * (s @ w_pos) + x_neg * (s @ w_neg)  # R_j
    return torch.where(x != 0, contribution / x, torch.zeros_like(x))  # g_x = R_x / x


def _gamma(x, weight, bias, grad, gamma):
    output = x @ weight.t() + bias
    w_gamma, b_gamma = weight + gamma * weight.clamp(min=0), bias + gamma * bias.clamp(min=0)
    z = x @ w_gamma.t() + b_gamma
    return torch.where(z != 0, output * grad / (z + 1e-9 * z.sign()), torch.zeros_like(z)) @ w_gamma


@pytest.mark.parametrize("per_example_bias", [False, True])
@pytest.mark.parametrize("linear", ["alpha1beta0", "gamma"])
def test_rule_with_a_recomputed_output_equals_the_rule_from_its_definition(monkeypatch, linear, per_example_bias):
    monkeypatch.setattr(lr, "_CHUNK_ELEMENTS", 64)  # several chunks of rows
    torch.manual_seed(0)
    # Magnitudes in [0.5, 1.5] over 32 inputs: every z+ is far from 0, where Eq. 5 is well conditioned
    # (near z+ = 0 the paper's sum and the rule's three-product form differ by rounding, amplified).
    def away_from_zero(*shape):
        return (torch.rand(*shape, dtype=F64) + 0.5) * torch.randn(*shape, dtype=F64).sign()

    x = away_from_zero(3, 5, 32).requires_grad_()
    weight, grad = away_from_zero(4, 32), torch.randn(3, 5, 4, dtype=F64)
    bias = torch.randn(3, 5, 4, dtype=F64) if per_example_bias else torch.randn(4, dtype=F64)
    if linear == "gamma" and per_example_bias:
        pytest.skip("addmm's per-example bias reaches only the alpha=1/beta=0 rule (GPT-2's Conv1D)")
    rules = dataclasses.replace(RuleSet.GRADIENT, linear=linear, gamma=0.25 if linear == "gamma" else 0.0)
    func = (lambda a, w, b: a @ w.t() + b) if per_example_bias else F.linear
    y = lr.linear_rule(rules, x, weight, bias, func, (x, weight, bias), {})
    saved = y.grad_fn.saved_tensors
    assert len(saved) == 3 and not any(t is not None and t.shape == y.shape and torch.equal(t, y) for t in saved[:2])
    (found,) = torch.autograd.grad(y, x, grad)
    with torch.no_grad():
        expected = _alpha1beta0(x, weight, bias, grad) if linear == "alpha1beta0" else _gamma(x, weight, bias, grad, 0.25)
    torch.testing.assert_close(found, expected, rtol=1e-10, atol=1e-12)
    assert found.abs().max() > 1e-3


@pytest.mark.parametrize("linear", ["alpha1beta0", "gamma"])
def test_a_bias_computed_from_the_input_gets_the_plain_gradient(linear):
    """``addmm(M, x, W)`` with an activation ``M``: before, the rule returned nothing for ``M``, and
    every path through it was cut from the explanation."""
    torch.manual_seed(1)
    x = torch.randn(5, 6, dtype=F64, requires_grad=True)
    weight, grad = torch.randn(4, 6, dtype=F64), torch.randn(5, 4, dtype=F64)
    rules = dataclasses.replace(RuleSet.GRADIENT, linear=linear, gamma=0.25 if linear == "gamma" else 0.0)
    bias = x[:, :4] * 2.0  # computed from the input
    y = lr.linear_rule(rules, x, weight, bias, lambda a, w, b: a @ w.t() + b, (x, weight, bias), {})
    (through_rule,) = torch.autograd.grad(y, x, grad)
    leaf_bias = bias.detach().requires_grad_()
    y_leaf = lr.linear_rule(rules, x, weight, leaf_bias, lambda a, w, b: a @ w.t() + b, (x, weight, leaf_bias), {})
    (rule_only,) = torch.autograd.grad(y_leaf, x, grad)
    expected = rule_only.clone()
    expected[:, :4] += 2.0 * grad  # the plain gradient through M = 2 x[:, :4]
    torch.testing.assert_close(through_rule, expected, rtol=0, atol=1e-12)
