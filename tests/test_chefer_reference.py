"""Chefer et al. (CVPR 2021) Sec. 3 written out: explicit relprop per example, layer and head on a
float64 HF ViT, against TransformerRelevance, PartialLRP and TransformerLRP."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")

from captum_transformers import (  # noqa: E402
    AttnLRP,
    PartialLRP,
    RuleGradientXInput,
    RuleSet,
    TransformerLRP,
    TransformerRelevance,
)
from captum_transformers.model_state import patching
from captum_transformers.propagation.rules.operations import operation_rules  # noqa: E402
from captum_transformers.propagation.rules.rule_set import norm_rules  # noqa: E402

F64 = torch.float64
OPERATION_PRESETS = [pytest.param(rules, id=rules.name) for rules in (RuleSet.CHEFER, RuleSet.LRP, RuleSet.ATTN_LRP)]
METHODS = [pytest.param(m, id=m.__name__) for m in (TransformerRelevance, PartialLRP, TransformerLRP, AttnLRP)]
from chefer_models import _hf_vit, _images, _relative  # noqa: E402


# == 2. the slow reference: Chefer et al. Sec. 3, written out ===================================
def _divide(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator``, 0 where the denominator is 0 (the rules' safe division)."""
    zero = denominator == 0
    return torch.where(zero, torch.zeros_like(numerator), numerator / torch.where(zero, 1, denominator))


def _eq5(x: torch.Tensor, weight: torch.Tensor, relevance: torch.Tensor, separate: bool = False) -> torch.Tensor:
    """Eq. 5 (alpha=1, beta=0) for ``y = W x + b`` per token, the bias ignored:
    ``R(x_j) = sum_i (x_j w_ij)+ / sum_j' (x_j' w_ij')+ R(y_i)``. x (T, in), W (out, in), R (T, out).

    ``separate=True``: the authors' LRP baseline, the same rule applied to the (x+, w+) and the
    (x-, w-) pairs with one denominator each (each pair type receives all of R(y_i))."""
    products = x[:, None, :] * weight[None]  # (T, out, in)
    positive = products.clamp(min=0)
    if not separate:
        return (positive * _divide(relevance, positive.sum(-1))[..., None]).sum(1)
    from_pos = positive * (x[:, None, :] > 0)
    from_neg = positive * (x[:, None, :] < 0)
    return sum((part * _divide(relevance, part.sum(-1))[..., None]).sum(1) for part in (from_pos, from_neg))


def _residual(u: torch.Tensor, v: torch.Tensor, relevance: torch.Tensor, normalize: bool):
    """``u + v``: the z-rule split (Eq. 2 with identity weights), then Sec. 3.2's normalisation
    (per example): ``Rbar_u = R_u |S_u| / (|S_u| + |S_v|) * S / S_u``."""
    r_u, r_v = u * _divide(relevance, u + v), v * _divide(relevance, u + v)
    if normalize:
        s_u, s_v, s = r_u.sum(), r_v.sum(), relevance.sum()
        r_u = r_u * _divide(s_u.abs() / (s_u.abs() + s_v.abs()) * s, s_u)
        r_v = r_v * _divide(s_v.abs() / (s_u.abs() + s_v.abs()) * s, s_v)
    return r_u, r_v


def _bilinear(u: torch.Tensor, v: torch.Tensor, relevance: torch.Tensor):
    """``Z = U V``: the z-rule (Eq. 6, App. B) gives each operand the whole relevance; halved."""
    ratio = _divide(relevance, u @ v)
    return u * (ratio @ v.T) / 2, v * (u.T @ ratio) / 2


def _layer_norm(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], norm.weight, norm.bias, norm.eps)


def _explicit_forward(model, pixels: torch.Tensor):
    """One image through the HF ViT, written out. Returns (logits, final hidden, per-layer caches)."""
    vit, heads = model.vit, model.config.num_attention_heads
    width = model.config.hidden_size // heads
    conv = vit.embeddings.patch_embeddings.projection
    patches = F.conv2d(pixels[None], conv.weight, conv.bias, stride=conv.stride)[0].flatten(1).T
    h = torch.cat([vit.embeddings.cls_token[0], patches]) + vit.embeddings.position_embeddings[0]
    caches = []
    for layer in vit.layers:
        attention, mlp = layer.attention, layer.mlp
        c = dict(h=h, n1=_layer_norm(h, layer.layernorm_before))
        for name in ("q", "k", "v"):
            linear = getattr(attention, f"{name}_proj")
            c[name] = F.linear(c["n1"], linear.weight, linear.bias)
        c["A"], outputs = [], []
        for head in range(heads):
            cols = slice(head * width, (head + 1) * width)
            scores = (c["q"][:, cols] @ c["k"][:, cols].T) * width ** -0.5
            # softmax(Q K^T / sqrt(d)) in the model's float64, as the package's kernel and HF's sdpa
            # compute it (HF ViT's eager kernel casts to float32).
            c["A"].append(torch.softmax(scores, dim=-1))
            outputs.append(c["A"][-1] @ c["v"][:, cols])
        c["o"] = torch.cat(outputs, dim=1)
        c["a"] = F.linear(c["o"], attention.o_proj.weight, attention.o_proj.bias)
        c["mid"] = c["a"] + h
        c["n2"] = _layer_norm(c["mid"], layer.layernorm_after)
        c["f1"] = F.linear(c["n2"], mlp.fc1.weight, mlp.fc1.bias)
        c["g"] = F.gelu(c["f1"])
        c["f2"] = F.linear(c["g"], mlp.fc2.weight, mlp.fc2.bias)
        h = c["f2"] + c["mid"]
        caches.append(c)
    out = _layer_norm(h, vit.layernorm)
    return F.linear(out[0], model.classifier.weight, model.classifier.bias), out, caches


def _explicit_relevance(model, pixels: torch.Tensor, target: int, normalize: bool = True) -> dict:
    """Chefer et al.'s rules (docs/relevance-rules.md Sec. 1) propagated by hand for one image.

    ``normalize=True``: the paper's rules (RuleSet.CHEFER); False: the authors' LRP baseline
    (RuleSet.LRP): no residual normalisation and Eq. 5 with separate denominators. Returns the logits, per layer the relevance at the
    softmax output ``R_A`` (H, N, N) and the plain gradient ``dA`` (H, N, N), and the relevance
    at the first layer's input summed over the hidden size (N,).
    """
    sep = not normalize
    with torch.enable_grad():
        logits, out, caches = _explicit_forward(model, pixels)
        flat = [a for c in caches for a in c["A"]]
        gradients = torch.autograd.grad(logits[target], flat)  # plain dA: the full gradient, every path
    heads = model.config.num_attention_heads
    width = model.config.hidden_size // heads
    d_a = [torch.stack(gradients[i * heads:(i + 1) * heads]) for i in range(len(caches))]
    r_a = []
    with torch.no_grad():
        seed = torch.zeros_like(logits)
        seed[target] = 1.0  # R(0) = 1_t
        relevance = torch.zeros_like(out)
        relevance[0] = _eq5(out[0][None], model.classifier.weight, seed[None], sep)[0]  # head; CLS select
        # final LayerNorm: identity
        for layer, c in zip(reversed(list(model.vit.layers)), reversed(caches)):
            attention = layer.attention
            r_f2, r_mid = _residual(c["f2"], c["mid"], relevance, normalize)
            r_g = _eq5(c["g"], layer.mlp.fc2.weight, r_f2, sep)
            r_f1 = r_g  # GELU: identity
            r_n2 = _eq5(c["n2"], layer.mlp.fc1.weight, r_f1, sep)
            r_mid = r_mid + r_n2  # LayerNorm: identity; the fork sums its branches
            r_attn, r_h = _residual(c["a"], c["h"], r_mid, normalize)
            r_o = _eq5(c["o"], attention.o_proj.weight, r_attn, sep)
            r_q, r_k, r_v = (torch.zeros_like(c[n]) for n in ("q", "k", "v"))
            layer_r_a = []
            for head in range(heads):
                cols = slice(head * width, (head + 1) * width)
                r_probs, r_v[:, cols] = _bilinear(c["A"][head], c["v"][:, cols], r_o[:, cols])
                layer_r_a.append(r_probs)
                # softmax: identity; the 1/sqrt(d) scale: identity; Q K^T on the unscaled product
                r_q[:, cols], k_t = _bilinear(c["q"][:, cols], c["k"][:, cols].T, r_probs)
                r_k[:, cols] = k_t.T
            r_a.insert(0, torch.stack(layer_r_a))
            r_n1 = sum(_eq5(c["n1"], getattr(attention, f"{n}_proj").weight, r, sep)
                       for n, r in (("q", r_q), ("k", r_k), ("v", r_v)))
            relevance = r_h + r_n1  # LayerNorm: identity; fork: sum
    return dict(logits=logits.detach(), r_a=r_a, d_a=d_a, tokens=relevance.sum(-1))


def _eq13(reference: dict) -> list:
    """Eq. 13 without the identity: ``E_h[(dA * R_A)+]`` per layer."""
    return [(g * r).clamp(min=0).mean(0) for g, r in zip(reference["d_a"], reference["r_a"])]


def _eq14_cls_row(reference: dict, start_layer: int = 0) -> torch.Tensor:
    """Eq. 14: ``C = Abar_L ... Abar_s`` with ``Abar = I + E_h[(dA * R_A)+]``, later layers on
    the left; the CLS row (all tokens, CLS included)."""
    maps = _eq13(reference)
    eye = torch.eye(maps[0].shape[-1], dtype=maps[0].dtype)
    product = eye
    for layer_map in maps[start_layer:]:
        product = (eye + layer_map) @ product
    return product[0]


def _bert_generator_cls_row(reference: dict, start_layer: int = 0) -> torch.Tensor:
    """The authors' BERT generator (``generate_LRP`` and its ``compute_rollout_attention``):
    ``M_b = E_h[(dA * R_A)+]``; each ``M_b + I`` divided by its row sums; the product of the
    layers from ``start_layer`` on, later layers on the left; the CLS row (before their
    CLS-entry overwrite)."""
    maps = _eq13(reference)
    eye = torch.eye(maps[0].shape[-1], dtype=maps[0].dtype)
    augmented = [(m + eye) / (m + eye).sum(dim=-1, keepdim=True) for m in maps]
    joint = augmented[start_layer]
    for layer_map in augmented[start_layer + 1:]:
        joint = layer_map @ joint
    return joint[0]


REFERENCE_TARGETS = [0, 3, 2]


@pytest.fixture(scope="module")
def reference_case():
    model = _hf_vit()
    x = _images()
    chefer = [_explicit_relevance(model, x[b], t) for b, t in enumerate(REFERENCE_TARGETS)]
    lrp = [_explicit_relevance(model, x[b], t, normalize=False) for b, t in enumerate(REFERENCE_TARGETS)]
    return model, x, chefer, lrp


def test_reference_forward_is_the_model(reference_case):
    model, x, chefer, _ = reference_case
    expected = torch.stack([r["logits"] for r in chefer])
    with patching.hf_attention_implementation(model, "sdpa"):  # float64 throughout (eager: a float32 softmax)
        own = model(x).logits.detach()
    torch.testing.assert_close(own, expected, rtol=1e-12, atol=1e-14)  # measured 1e-16
    # The relevance-weighted maps are far from trivial on this model (not just the identity).
    assert min(float(m.abs().max()) for r in chefer for m in _eq13(r)) > 1e-3


def test_transformer_relevance_equals_eq13_14(reference_case):
    model, x, chefer, _ = reference_case
    method = TransformerRelevance(model)
    # Every layer's E_h[(dA * R_A)+] (the trace keeps one fused map per layer) ...
    trace = method.trace(x, target=REFERENCE_TARGETS)
    for layer, record in enumerate(trace.records):
        expected = torch.stack([_eq13(r)[layer] for r in chefer])
        # Measured max |diff| / max: 1.6e-8 (layer 0), 1.4e-8 (layer 1), when the kernel's softmax ran in
        # float32. Not 1e-15: Eq. 5's stabiliser (z+ + 1e-9).
        assert _relative(record.backward_value, expected) <= 1e-6, layer
    # ... and the CLS row of the product (Eq. 14).
    maps = method.attribute(x, target=REFERENCE_TARGETS, return_tokens=True)
    expected = torch.stack([_eq14_cls_row(r) for r in chefer])
    informative = float((expected[:, 1:]).abs().max())
    torch.testing.assert_close(maps, expected, rtol=1e-6, atol=1e-6 * informative)  # measured: rel 4.6e-8
    # start_layer=1 leaves the first layer out of the product.
    maps = TransformerRelevance(model, start_layer=1).attribute(x, target=REFERENCE_TARGETS, return_tokens=True)
    expected_1 = torch.stack([_eq14_cls_row(r, start_layer=1) for r in chefer])
    torch.testing.assert_close(maps, expected_1, rtol=1e-6, atol=1e-6 * informative)
    assert (expected_1 - expected).abs().max() > 1e-2 * informative


@pytest.mark.parametrize("start_layer", [0, 1])
def test_row_normalized_transformer_relevance_equals_the_authors_bert_generator(reference_case, start_layer):
    model, x, chefer, _ = reference_case
    maps = TransformerRelevance(model, start_layer=start_layer, row_normalize=True).attribute(
        x, target=REFERENCE_TARGETS, return_tokens=True)
    expected = torch.stack([_bert_generator_cls_row(r, start_layer) for r in chefer])
    torch.testing.assert_close(maps, expected, rtol=1e-6, atol=1e-6 * float(expected.abs().max()))
    # Each row of the product sums to 1 (a product of row-stochastic maps) ...
    torch.testing.assert_close(maps.sum(-1), torch.ones(3, dtype=maps.dtype), rtol=1e-10, atol=1e-10)
    # ... and over two layers it is not the unnormalised Eq. 14 rescaled (over one layer it is).
    plain = torch.stack([_eq14_cls_row(r, start_layer) for r in chefer])
    if start_layer == 0:
        assert _relative(maps, plain / plain.sum(-1, keepdim=True)) > 1e-3


def test_partial_lrp_equals_last_layer_relevance(reference_case):
    model, x, chefer, lrp = reference_case
    for rules, references in ((None, lrp), (RuleSet.CHEFER, chefer), (RuleSet.LRP, lrp)):
        method = PartialLRP(model) if rules is None else PartialLRP(model, rules=rules)
        maps = method.attribute(x, target=REFERENCE_TARGETS, return_tokens=True)
        expected = torch.stack([r["r_a"][-1].clamp(min=0).mean(0)[0] for r in references])
        assert _relative(maps, expected) <= 1e-6, rules  # measured 7.6e-9 (CHEFER), 1.6e-9 (LRP)
    # The two rule sets differ (separate denominators, unnormalised adds) in both layers.
    r_a = {name: [torch.stack([r["r_a"][layer] for r in refs]) for layer in range(2)]
           for name, refs in (("chefer", chefer), ("lrp", lrp))}
    assert _relative(r_a["lrp"][0], r_a["chefer"][0]) > 1e-1


def test_transformer_lrp_equals_explicit_relprop(reference_case):
    model, x, chefer, lrp = reference_case
    tokens = TransformerLRP(model).attribute(x, target=REFERENCE_TARGETS, return_tokens=True)
    expected = torch.stack([r["tokens"] for r in lrp])
    assert _relative(tokens, expected) <= 1e-6  # measured 3.2e-8
    # The paper's full rule set (normalised residuals) read at the same place.
    tokens = RuleGradientXInput(model, RuleSet.CHEFER).attribute(x, target=REFERENCE_TARGETS, return_tokens=True)
    expected_chefer = torch.stack([r["tokens"] for r in chefer])
    assert _relative(tokens, expected_chefer) <= 1e-6  # measured 1.5e-8
    assert _relative(expected, expected_chefer) > 1e-1  # measured 2.2
    # The paper's rules conserve the seed (the stabiliser-free reference to 1e-12); the baseline's
    # separate denominators do not (each pair type receives the whole relevance).
    torch.testing.assert_close(expected_chefer.sum(-1), torch.ones(3, dtype=F64), rtol=0, atol=1e-10)
    assert (expected.sum(-1) - 1).abs().max() > 1e-1


def test_identity_rules_pass_relevance_unchanged_for_tiny_inputs():
    # Regression: the identity rules used to divide by x + 1e-9 * sign(x), so R_in = R_out x / (x + eps):
    # half the relevance at |x| = 1e-9. Now R_in = R_out exactly (0 where x == 0).
    x = torch.tensor([[1e-9, -1e-9, 3e-12, 0.8, -1.3, 0.0, 2.1, -4e-7]], dtype=F64)
    weights = torch.randn(1, 8, generator=torch.Generator().manual_seed(0), dtype=F64)

    class Softmax(nn.Module):
        def forward(self, t):
            return torch.softmax(t, dim=-1)

    class Tanh(nn.Module):
        def forward(self, t):
            return torch.tanh(t)

    norm = nn.LayerNorm(8).to(F64)
    for module, install in ((Softmax(), operation_rules), (Tanh(), operation_rules), (norm, norm_rules)):
        leaf = x.clone().requires_grad_()
        with install(module, RuleSet.CHEFER):
            y = module(leaf)
        (g,) = torch.autograd.grad(y, leaf, weights)
        r_in, r_out = leaf.detach() * g, y.detach() * weights
        expected = torch.where(x == 0, 0.0, r_out)
        torch.testing.assert_close(r_in, expected, rtol=1e-12, atol=0), type(module).__name__


