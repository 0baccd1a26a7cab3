"""The AH rule's attention differentiated with respect to V only (propagation/constant_map_attention).

``g_V = A^T g_O`` from the map recomputed in blocks of query rows (keys no row of a block sees
left out) equals autograd through an explicit ``softmax(s Q K^T + M).detach() @ V`` in float64
(grouped-query heads, boolean padding and causal masks, a row that sees no key, additive masks,
blocks of one row); the forward is the call it wraps; a
ConservativeLRP explanation of an sdpa model takes the path once per layer.
"""
from __future__ import annotations

import pytest
import torch

from captum_transformers import ConservativeLRP
from captum_transformers.propagation.attention import constant_map as constant_map_attention
from captum_transformers.propagation.attention.constant_map import attention_over_constant_map

B, H, H_KV, Q, D = 2, 4, 2, 6, 3


def _explicit(query, key, value, mask, scale):
    keys = key.repeat_interleave(H // key.shape[1], dim=1)
    values = value.repeat_interleave(H // value.shape[1], dim=1)
    scores = query @ keys.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool else scores + mask
    return (torch.softmax(scores, -1).detach() @ values).transpose(1, 2)


def _masks():
    causal = torch.ones(Q, Q, dtype=torch.bool).tril()[None, None]
    padded = causal.expand(B, 1, Q, Q).clone()
    padded[1, ..., :2] = False          # the second example is left-padded by two tokens
    padded[1, :, :2, :2] = torch.eye(2, dtype=torch.bool)  # its padding rows see themselves
    additive = torch.randn(B, 1, Q, Q, dtype=torch.float64)
    empty_row = causal.expand(B, 1, Q, Q).clone()
    empty_row[0, :, 1] = False          # a row that sees no key: uniform over every key, as finfo.min makes it
    return {"none": None, "causal": causal, "padded": padded, "additive": additive, "empty-row": empty_row}


@pytest.mark.parametrize("mask_name", ["none", "causal", "padded", "additive", "empty-row"])
@pytest.mark.parametrize("block_rows", [1, 4, 1000])
def test_value_gradient_equals_autograd_through_the_detached_map(mask_name, block_rows, monkeypatch):
    monkeypatch.setattr(constant_map_attention, "_BLOCK_ELEMENTS", block_rows * B * H * Q)
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(B, H, Q, D, generator=generator, dtype=torch.float64)
    key = torch.randn(B, H_KV, Q, D, generator=generator, dtype=torch.float64)
    value = torch.randn(B, H_KV, Q, D, generator=generator, dtype=torch.float64, requires_grad=True)
    mask, scale = _masks()[mask_name], 0.7
    weights = torch.randn(B, Q, H, D, generator=generator, dtype=torch.float64)
    expected_output = _explicit(query, key, value, mask, scale)
    (expected,) = torch.autograd.grad((expected_output * weights).sum(), value)
    output = attention_over_constant_map(lambda v: _explicit(query, key, v, mask, scale), query, key, value, mask, scale)
    assert torch.equal(output.detach(), expected_output.detach())
    (found,) = torch.autograd.grad((output * weights).sum(), value)
    torch.testing.assert_close(found, expected, rtol=0, atol=1e-12)


def test_queries_or_keys_that_need_a_gradient_are_refused():
    query = torch.randn(1, 1, 2, 2, requires_grad=True)
    with pytest.raises(ValueError, match="must not require grad"):
        attention_over_constant_map(lambda v: v, query, query.detach(), query.detach(), None, 1.0)


def test_conservative_lrp_on_an_sdpa_model_takes_the_value_only_backward(monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    calls = []
    original = constant_map_attention.value_gradient
    monkeypatch.setattr(constant_map_attention, "value_gradient", lambda *a: calls.append(1) or original(*a))
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    ConservativeLRP(model).attribute(ids, target=3, return_tokens=True)
    assert len(calls) == 2
