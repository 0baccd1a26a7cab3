"""SDPA calls run as an explicit softmax attention (adapters/sdpa_kernel.py).

1. The result equals ``F.scaled_dot_product_attention`` (no mask, boolean and additive
   masks, causal, grouped-query heads, a custom scale) and is bit-identical to timm's own
   explicit attention path.
2. The map handed to ``report`` is the softmax attention; in training mode with attention
   dropout the map is reported before dropout.
3. The interception is reversible and touches only SDPA calls of the wrapped module.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from captum_transformers.adapters.timm.sdpa_kernel import explicit_sdpa, sdpa_as_softmax_attention

timm = pytest.importorskip("timm")

B, H, Q, K, D = 2, 4, 5, 7, 8


def _qkv(kv_heads=H, dtype=torch.float64):
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(B, H, Q, D, generator=generator, dtype=dtype)
    key = torch.randn(B, kv_heads, K, D, generator=generator, dtype=dtype)
    value = torch.randn(B, kv_heads, K, D, generator=generator, dtype=dtype)
    return query, key, value


def _bool_mask():
    mask = torch.ones(B, 1, Q, K, dtype=torch.bool)
    mask[1, ..., -3:] = False
    return mask


CASES = {
    "plain": ({}, H),
    "bool-mask": ({"attn_mask": _bool_mask()}, H),
    "additive-mask": ({"attn_mask": torch.linspace(-2, 1, Q * K, dtype=torch.float64).reshape(Q, K)}, H),
    "causal": ({"is_causal": True}, H),
    "scale": ({"scale": 0.3}, H),
    "gqa": ({"enable_gqa": True}, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_equals_scaled_dot_product_attention(case):
    kwargs, kv_heads = CASES[case]
    query, key, value = _qkv(kv_heads)
    maps = []
    output = sdpa_as_softmax_attention(query, key, value, **kwargs, report=lambda probs, observer: maps.append(probs))
    expected = F.scaled_dot_product_attention(query, key, value, **kwargs)
    torch.testing.assert_close(output, expected, rtol=1e-12, atol=1e-12)
    (probs,) = maps
    assert probs.shape == (B, H, Q, K)
    torch.testing.assert_close(probs.sum(-1), torch.ones(B, H, Q, dtype=probs.dtype))
    if case == "causal":
        assert torch.all(probs.triu(1) == 0)
    if case == "bool-mask":
        assert torch.all(probs[1, ..., -3:] == 0)


def _timm_attention(**kwargs):
    from timm.layers import Attention

    torch.manual_seed(0)
    return Attention(32, num_heads=4, qkv_bias=True, **kwargs).eval()


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "bool-mask"])
def test_bit_identical_to_timms_explicit_path(masked):
    attention = _timm_attention()
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1))
    mask = None
    if masked:
        mask = torch.ones(2, 1, 6, 6, dtype=torch.bool)
        mask[0, ..., -2:] = False
    attention.fused_attn = False
    explicit = attention(x, attn_mask=mask)
    attention.fused_attn = True
    fused = attention(x, attn_mask=mask)
    maps = []
    with explicit_sdpa(attention, lambda probs, observer: maps.append(probs)):
        intercepted = attention(x, attn_mask=mask)
    assert torch.equal(intercepted, explicit)
    assert not torch.equal(fused, explicit)  # SDPA itself rounds differently: the check can fail
    assert len(maps) == 1 and maps[0].shape == (2, 4, 6, 6)
    # Reversible: the instance forward is gone and SDPA runs again.
    assert "forward" not in attention.__dict__
    assert torch.equal(attention(x, attn_mask=mask), fused)


def test_training_mode_reports_the_map_before_dropout():
    attention = _timm_attention(attn_drop=0.5).train()
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1))
    maps = []
    torch.manual_seed(3)
    with explicit_sdpa(attention, lambda probs, observer: maps.append(probs)):
        attention(x)
    (probs,) = maps
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4, 6))  # not dropped out
    assert probs.requires_grad


def test_other_modules_keep_their_sdpa_calls():
    attention, other = _timm_attention(), _timm_attention()
    x = torch.randn(2, 6, 32)
    maps = []
    with explicit_sdpa(attention, lambda probs, observer: maps.append(probs)):
        other(x)
    assert maps == []
