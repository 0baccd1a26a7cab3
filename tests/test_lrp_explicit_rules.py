"""Ali et al. Sec. 4: the detach trick (ConservativeLRP AH+LN) equals the explicit AH- and LN-rules
propagated by hand, one example at a time (slow reference)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")

from captum_transformers import ConservativeLRP  # noqa: E402
from lrp_models import *  # noqa: F401,F403,E402  (tiny models, cases and helpers)
from lrp_models import _random_norm_weights  # noqa: E402


# == 4. the detach trick == the paper's explicit rules ==========================================
def _z_rule(x: torch.Tensor, weights: torch.Tensor, relevance_out: torch.Tensor) -> torch.Tensor:
    """LRP-0 for a bias-free linear map ``y_j = sum_i x_i w_ij``:
    ``R(x_i) = sum_j x_i w_ij / (sum_i' x_i' w_i'j) R(y_j)``, with 0/0 = 0."""
    contributions = x[:, None] * weights
    denominators = contributions.sum(0)
    ratio = torch.where(denominators != 0, relevance_out / torch.where(denominators != 0, denominators, 1), 0)
    return (contributions * ratio[None, :]).sum(1)


def _ln_rule(s: torch.Tensor, relevance_out: torch.Tensor) -> torch.Tensor:
    """The LN-rule (Sec. 4): LRP-0 on ``alpha C x`` with the centering matrix
    ``C = I - 1/N``; ``alpha`` and each output's affine weight cancel in the ratio."""
    size = s.shape[0]
    centering = torch.eye(size, dtype=s.dtype) - 1.0 / size
    return _z_rule(s, centering, relevance_out)


def _explicit_lrp(model: EncoderClassifier, ids: torch.Tensor, padding: torch.Tensor, target: int):
    """Token relevance from the paper's rules, one example and one token at a time.

    Forward: the model's own computation written out (post-norm layers, bias-free).
    Backward: LRP-0 for the head and every linear map, the AH-rule per head and value
    dimension, the LN-rule, ReLU pass-through, residual sums split in proportion to the addends.
    Returns (token relevance (B, S), logits (B,)).
    """
    relevance_rows, logits = [], []
    head_weight = model.head.weight[target]
    with torch.no_grad():
        for b in range(ids.shape[0]):
            valid = ~padding[b]
            h = model.embed(ids[b])  # (S, D): the input of the first layer
            length = h.shape[0]
            cache = []
            for layer in model.encoder.layers:
                attention = layer.self_attn
                heads, width = attention.num_heads, attention.head_dim
                w_q, w_k, w_v = attention.in_proj_weight.chunk(3)
                q, k, v = h @ w_q.T, h @ w_k.T, h @ w_v.T
                probs, o = [], torch.empty_like(v)
                for head in range(heads):
                    cols = slice(head * width, (head + 1) * width)
                    scores = (q[:, cols] @ k[:, cols].T) / math.sqrt(width)
                    p = torch.softmax(scores.masked_fill(~valid[None, :], float("-inf")), dim=-1)  # p[j, i]
                    probs.append(p)
                    o[:, cols] = p @ v[:, cols]
                a = o @ attention.out_proj.weight.T
                s1 = h + a
                y1 = F.layer_norm(s1, (s1.shape[-1],), layer.norm1.weight, None, layer.norm1.eps)
                pre = y1 @ layer.linear1.weight.T
                hidden = torch.relu(pre)
                f = hidden @ layer.linear2.weight.T
                s2 = y1 + f
                y2 = F.layer_norm(s2, (s2.shape[-1],), layer.norm2.weight, None, layer.norm2.eps)
                cache.append(dict(x=h, v=v, probs=probs, o=o, a=a, s1=s1, y1=y1, pre=pre, hidden=hidden, f=f, s2=s2))
                h = y2
            final = model.encoder.norm
            out = F.layer_norm(h, (h.shape[-1],), final.weight, None, final.eps)
            logits.append(out[0] @ head_weight)

            # Backward. The head reads token 0: R(out_0) by LRP-0 (bias-free), other tokens 0.
            relevance = torch.zeros_like(out)
            relevance[0] = _z_rule(out[0], head_weight[:, None], (out[0] @ head_weight)[None])
            relevance = torch.stack([_ln_rule(h[t], relevance[t]) for t in range(length)])
            for layer, c in zip(reversed(model.encoder.layers), reversed(cache)):
                attention = layer.self_attn
                heads, width = attention.num_heads, attention.head_dim
                w_v = attention.in_proj_weight.chunk(3)[2]
                r_x = torch.zeros_like(c["x"])
                for t in range(length):
                    r_s2 = _ln_rule(c["s2"][t], relevance[t])
                    # Residual s2 = y1 + f: split in proportion to the addends.
                    both = torch.stack([c["y1"][t], c["f"][t]])  # (2, D) -> z-rule with identity weights
                    r_y1 = both[0] / both.sum(0) * r_s2
                    r_f = both[1] / both.sum(0) * r_s2
                    r_hidden = _z_rule(c["hidden"][t], layer.linear2.weight.T, r_f)
                    r_pre = r_hidden  # ReLU: relevance passes through (0 where the unit is off)
                    r_y1 = r_y1 + _z_rule(c["y1"][t], layer.linear1.weight.T, r_pre)
                    r_s1 = _ln_rule(c["s1"][t], r_y1)
                    r_x[t] = c["x"][t] / c["s1"][t] * r_s1
                    relevance[t] = c["a"][t] / c["s1"][t] * r_s1  # R(a_t), reused below
                r_o = torch.stack([_z_rule(c["o"][t], attention.out_proj.weight.T, relevance[t]) for t in range(length)])
                # AH-rule, per head and value dimension: y_j = sum_i v_i p_ij with p constant.
                r_v = torch.zeros_like(c["v"])
                for head in range(heads):
                    p = c["probs"][head]  # p[j, i]: query j, key i
                    for d in range(head * width, (head + 1) * width):
                        r_v[:, d] = _z_rule(c["v"][:, d], p.T, r_o[:, d])
                # Value projection (LRP-0); query and key receive nothing under the AH-rule.
                for t in range(length):
                    r_x[t] = r_x[t] + _z_rule(c["x"][t], w_v.T, r_v[t])
                relevance = r_x
            relevance_rows.append(relevance.sum(-1))
    return torch.stack(relevance_rows), torch.stack(logits)


def test_detach_trick_equals_explicit_rules():
    torch.manual_seed(0)
    model = _random_norm_weights(EncoderClassifier(final_norm=nn.LayerNorm(DIM, bias=False)).to(F64).eval())
    ids = torch.randint(0, VOCAB, (3, 6), generator=torch.Generator().manual_seed(1))
    padding = torch.zeros(3, 6, dtype=torch.bool)
    padding[1, 4:] = True
    target = 2
    reference, reference_logits = _explicit_lrp(model, ids, padding, target)
    # The written-out forward is the model's, and the explicit rules conserve by construction.
    torch.testing.assert_close(reference_logits, model(ids, padding)[:, target].detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(reference.sum(-1), reference_logits, rtol=1e-9, atol=1e-12)
    assert torch.all(reference[1, 4:] == 0)

    relevance = ConservativeLRP(model).attribute(ids, target=target, return_tokens=True,
                                                 additional_forward_args=(padding,))
    torch.testing.assert_close(relevance, reference, rtol=1e-6, atol=1e-10)  # measured: max |diff| 1.4e-15
    # Not trivially: GI and AH alone are far from the explicit rules.
    for variant in ("GI", "AH"):
        other = ConservativeLRP(model, variant).attribute(ids, target=target, return_tokens=True,
                                                          additional_forward_args=(padding,))
        assert (other - reference).abs().max() > 1e-2 * reference.abs().max()

