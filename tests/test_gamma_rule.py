"""LRP-gamma on linear layers (``RuleSet(linear="gamma", gamma=...)``), float64.

The rule (Montavon et al. 2019; Ali et al.'s code, ``make_p_layer``):
``z_ij = x_j (w_ij + gamma w_ij^+)``, ``z_i = sum_j z_ij + b_i + gamma b_i^+``,
``R_j = sum_i z_ij / z_i * R_i``. What is conserved, exactly, through one layer:
``sum_j R_j = sum_i R_i (z_i - b_i - gamma b_i^+) / (z_i + 1e-9 sign(z_i))`` (the bias share is
absorbed; the 1e-9 is the package's sign-aware stabiliser); without biases ``sum_j R_j =
sum_i R_i`` up to that stabiliser, and through a bias-free ReLU model with the AH+LN rules the
input relevance sums to the logit.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from captum_transformers import InputError, RuleGradientXInput, RuleSet, get_adapter
from captum_transformers.propagation.rules import linear as linear_rule
from captum_transformers.propagation.backward_switch import switchable_backward
from captum_transformers.propagation.rules.operations import operation_rules
from lrp_models import CONSERVATION_CASES  # noqa: E402

F64 = torch.float64


def _gamma_rules(gamma: float, base: RuleSet = RuleSet.GRADIENT) -> RuleSet:
    return dataclasses.replace(base, name=f"{base.name}, gamma={gamma}", linear="gamma", gamma=gamma)


def _layer(bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(7, 5, bias=bias).double()
    if bias:
        nn.init.normal_(layer.bias, std=0.5)
    return layer


def _rule_relevance(layer: nn.Linear, x: torch.Tensor, relevance_out: torch.Tensor, rules: RuleSet) -> torch.Tensor:
    """``R_x = x * g_x`` under ``rules`` for a seed ``R_y`` (the gradient ``R_y / y`` at the output)."""
    leaf = x.clone().requires_grad_()
    with operation_rules(layer, rules):
        y = layer(leaf)
    (g,) = torch.autograd.grad(y, leaf, relevance_out / y.detach())
    return leaf.detach() * g


def _reference(layer: nn.Linear, x: torch.Tensor, relevance_out: torch.Tensor, gamma: float) -> torch.Tensor:
    """The rule written out per (row, output, input), with the package's stabiliser
    ``z_i + 1e-9 sign(z_i)`` (a near-zero ``z_i`` of a random layer moves the result by 1e-7)."""
    w = layer.weight.detach()
    b = layer.bias.detach() if layer.bias is not None else torch.zeros(w.shape[0], dtype=w.dtype)
    w_gamma, b_gamma = w + gamma * w.clamp(min=0), b + gamma * b.clamp(min=0)
    out = torch.zeros_like(x)
    for row in range(x.shape[0]):
        for i in range(w.shape[0]):
            z_i = sum(x[row, j] * w_gamma[i, j] for j in range(w.shape[1])) + b_gamma[i]
            z_i = z_i + 1e-9 * torch.sign(z_i)
            for j in range(w.shape[1]):
                out[row, j] += x[row, j] * w_gamma[i, j] / z_i * relevance_out[row, i]
    return out


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("gamma", [0.0, 0.25, 1.0])
def test_gamma_rule_equals_the_written_out_rule_and_conserves_what_it_should(gamma, bias):
    layer = _layer(bias)
    x = torch.randn(4, 7, dtype=F64, generator=torch.Generator().manual_seed(1))
    relevance_out = torch.randn(4, 5, dtype=F64, generator=torch.Generator().manual_seed(2))
    ours = _rule_relevance(layer, x, relevance_out, _gamma_rules(gamma))
    torch.testing.assert_close(ours, _reference(layer, x, relevance_out, gamma), rtol=1e-10, atol=1e-12)

    # The exact conserved quantity (stabiliser included), per row.
    w, b = layer.weight.detach(), layer.bias.detach() if bias else None
    w_gamma = w + gamma * w.clamp(min=0)
    b_gamma = b + gamma * b.clamp(min=0) if bias else torch.zeros(5, dtype=F64)
    z = x @ w_gamma.T + b_gamma
    kept = relevance_out * (z - b_gamma) / (z + 1e-9 * torch.sign(z))
    torch.testing.assert_close(ours.sum(-1), kept.sum(-1), rtol=1e-12, atol=1e-13)
    if not bias:  # all of it, up to the stabiliser
        torch.testing.assert_close(ours.sum(-1), relevance_out.sum(-1), rtol=1e-5, atol=1e-7)
    else:  # the biases absorb a share: not conserved (the test could not pass by accident)
        assert (ours.sum(-1) - relevance_out.sum(-1)).abs().max() > 1e-3


def test_large_gamma_tends_to_the_z_plus_rule():
    # The original rule's setting: non-negative inputs (after a ReLU) and relevance. As gamma
    # grows, R_j -> sum_i x_j w_ij^+ / sum_j' x_j' w_ij'^+ R_i (the z+ rule): positive relevance.
    layer = _layer(bias=False)
    x = torch.rand(16, 7, dtype=F64, generator=torch.Generator().manual_seed(1))
    relevance_out = torch.rand(16, 5, dtype=F64, generator=torch.Generator().manual_seed(2))
    w_pos = layer.weight.detach().clamp(min=0)
    z_plus = x * (((relevance_out / (x @ w_pos.T))) @ w_pos)
    shares = []
    for gamma in (0.0, 1e2, 1e7):
        relevance = _rule_relevance(layer, x, relevance_out, _gamma_rules(gamma))
        shares.append(float(relevance.clamp(min=0).sum() / relevance.abs().sum()))
        if gamma == 1e7:
            torch.testing.assert_close(relevance, z_plus, rtol=1e-4, atol=1e-6)
    assert shares[0] < 0.7 < 0.97 < shares[1] <= shares[2]  # measured 0.58, 0.974, 0.9997


def test_gamma_zero_on_a_bias_free_layer_is_the_gradient():
    layer = _layer(bias=False)
    x = torch.randn(4, 7, dtype=F64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    seed = torch.randn(4, 5, dtype=F64, generator=torch.Generator().manual_seed(2))
    with operation_rules(layer, _gamma_rules(0.0)):
        y = layer(x)
    (rule,) = torch.autograd.grad(y, x, seed)
    (plain,) = torch.autograd.grad(layer(x), x, seed)
    torch.testing.assert_close(rule, plain, rtol=1e-7, atol=1e-12)


def test_forward_unchanged_and_plain_switch_gives_the_gradient():
    layer = _layer(bias=True)
    x = torch.randn(4, 7, dtype=F64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with switchable_backward() as switch, operation_rules(layer, _gamma_rules(0.25)):
        y = layer(x)
    assert torch.equal(y, layer(x))
    (rule,) = torch.autograd.grad(y.sum(), x, retain_graph=True)
    with switch.plain_gradient():
        (plain,) = torch.autograd.grad(y.sum(), x)
    (expected,) = torch.autograd.grad(layer(x).sum(), x)
    torch.testing.assert_close(plain, expected, rtol=1e-12, atol=1e-14)
    assert not torch.allclose(rule, expected)


@pytest.mark.parametrize("linear", ["gamma", "generalized_gamma"])
@pytest.mark.parametrize("case", ["hf_bert_no_pooler", "hf_vit", "timm_vit", "hf_gpt2", "torch_mha_encoder"])
def test_ah_ln_with_gamma_conserves_on_bias_free_relu_models(case, linear, monkeypatch):
    # LXT's ViT recipe: CP-LRP (AH, LN) with gamma on the linear layers. Bias-free, every
    # linear layer conserves up to the stabiliser, ReLU and the held gate and norm scale are
    # linear: the token relevance sums to the logit.
    model, x, kwargs, logits = CONSERVATION_CASES[case]()
    logits = logits.detach()
    rules = dataclasses.replace(RuleSet.AH_LN, name=f"AH+LN, {linear}", linear=linear, gamma=0.25)
    relevance = RuleGradientXInput(model, rules).attribute(x, target=1, return_tokens=True, forward_kwargs=kwargs)
    # With the stabiliser (1e-9 added to every |z_i|): measured up to 1.8e-6 of the logit.
    assert ((relevance.sum(-1) - logits).abs() / logits.abs()).max() <= 1e-5
    plain = RuleGradientXInput(model, RuleSet.AH_LN).attribute(x, target=1, return_tokens=True, forward_kwargs=kwargs)
    assert (relevance - plain).abs().max() > 1e-3 * plain.abs().max()  # gamma changed the map
    # Without it (1e-300), conservation is exact to float64 rounding: the stabiliser is the only
    # loss (delta: against the logit of the explained forward, whose softmax runs in float64).
    monkeypatch.setattr(linear_rule, "_TINY", 1e-300)
    _, delta = RuleGradientXInput(model, rules).attribute(x, target=1, return_tokens=True, forward_kwargs=kwargs,
                                                          return_convergence_delta=True)
    assert (delta.abs() / logits.abs()).max() <= 1e-12


def test_forward_bit_identical_inside_propagation_float32():
    from hf_models import CASES

    spec = CASES["bert"]
    model = spec.model("eager")
    x, kwargs = spec.inputs()
    with torch.enable_grad(), get_adapter(model).propagation(model, _gamma_rules(0.25, RuleSet.AH_LN)):
        inside = model(x, **kwargs).logits
    assert torch.equal(inside, model(x, **kwargs).logits)


def _generalized_reference(layer: nn.Linear, x: torch.Tensor, relevance_out: torch.Tensor, gamma: float):
    """zennit's generalised Gamma written out per (row, output, input): for an output z_i > 0
    the pairs (x_j > 0, w + gamma w+) and (x_j < 0, w + gamma w-) with bias b + gamma b+; for
    z_i < 0 the swapped pairs with bias b + gamma b-; the package's stabiliser."""
    w, b = layer.weight.detach(), layer.bias.detach()
    z = x @ w.T + b
    up, down = w + gamma * w.clamp(min=0), w + gamma * w.clamp(max=0)
    out = torch.zeros_like(x)
    for row in range(x.shape[0]):
        for i in range(w.shape[0]):
            if z[row, i] == 0:
                continue
            same, other = (up, down) if z[row, i] > 0 else (down, up)
            bias = b[i] + gamma * (b[i].clamp(min=0) if z[row, i] > 0 else b[i].clamp(max=0))
            terms = [x[row, j] * (same[i, j] if x[row, j] > 0 else other[i, j]) for j in range(w.shape[1])]
            denominator = sum(terms) + bias
            denominator = denominator + 1e-9 * torch.sign(denominator)
            for j in range(w.shape[1]):
                out[row, j] += terms[j] / denominator * relevance_out[row, i]
    return out


@pytest.mark.parametrize("gamma", [0.0, 0.25, 1.0])
def test_generalized_gamma_equals_zennits_rule_written_out(gamma):
    layer = _layer(bias=True)
    x = torch.randn(4, 7, dtype=F64, generator=torch.Generator().manual_seed(1))
    relevance_out = torch.randn(4, 5, dtype=F64, generator=torch.Generator().manual_seed(2))
    rules = dataclasses.replace(RuleSet.GRADIENT, name="generalized gamma", linear="generalized_gamma", gamma=gamma)
    ours = _rule_relevance(layer, x, relevance_out, rules)
    torch.testing.assert_close(ours, _generalized_reference(layer, x, relevance_out, gamma), rtol=1e-10, atol=1e-12)
    if gamma == 0:  # gamma = 0: LRP-0 with the bias absorbing, like the plain rule
        torch.testing.assert_close(ours, _rule_relevance(layer, x, relevance_out, _gamma_rules(0.0)),
                                   rtol=1e-10, atol=1e-12)


def test_generalized_gamma_conserves_bias_free_and_tends_to_same_sign_contributions():
    layer = _layer(bias=False)
    x = torch.randn(16, 7, dtype=F64, generator=torch.Generator().manual_seed(1))  # signed inputs
    relevance_out = torch.rand(16, 5, dtype=F64, generator=torch.Generator().manual_seed(2))
    shares = []
    for gamma in (0.0, 1.0, 1e2):
        rules = dataclasses.replace(RuleSet.GRADIENT, name="g", linear="generalized_gamma", gamma=gamma)
        relevance = _rule_relevance(layer, x, relevance_out, rules)
        # |D_i| >= |z_i| > 0: every output's relevance arrives, up to the 1e-9 stabiliser.
        torch.testing.assert_close(relevance.sum(-1), relevance_out.sum(-1), rtol=1e-6, atol=1e-8)
        shares.append(float(relevance.clamp(min=0).sum() / relevance.abs().sum()))
    # Positive relevance on positive outputs: the positive share grows with gamma, on signed
    # inputs too (the plain gamma rule does not promise that, see the z+ test above).
    assert shares[0] < shares[1] < shares[2] and shares[2] > 0.95, shares


@pytest.mark.parametrize("gamma", [-0.1, float("nan"), float("inf"), True, "0.25"])
def test_invalid_gamma_is_refused(gamma):
    with pytest.raises(InputError, match="RuleSet.gamma must be a finite number"):
        RuleSet(linear="gamma", gamma=gamma)


def test_gamma_without_the_gamma_rule_is_refused():
    with pytest.raises(InputError, match="acts only with linear='gamma' or 'generalized_gamma'"):
        RuleSet(gamma=0.25)
