"""heads_matmul: torch.matmul's values for per-head operands, strided heads read in place."""
from __future__ import annotations

import pytest
import torch

from captum_transformers.propagation.attention.head_products import heads_matmul

B, N, H, D = 3, 7, 4, 5


def _layouts():
    packed = torch.randn(B, N, 3, H, D, generator=torch.Generator().manual_seed(0))
    timm_q, timm_k, _ = packed.permute(2, 0, 3, 1, 4).unbind(0)          # timm: qkv.reshape(...).permute
    hf_q = torch.randn(B, N, H, D, generator=torch.Generator().manual_seed(1)).transpose(1, 2)  # HF: view, transpose
    contiguous = torch.randn(B, H, N, D, generator=torch.Generator().manual_seed(2))
    return {"timm": (timm_q, timm_k), "hf": (hf_q, contiguous), "contiguous": (contiguous, contiguous * 2)}


@pytest.mark.parametrize("layout", ["timm", "hf", "contiguous"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_equals_matmul_bit_for_bit(layout, dtype):
    query, key = (t.to(dtype) for t in _layouts()[layout])
    with torch.no_grad():
        scores = heads_matmul(query, key.transpose(-1, -2))
        assert torch.equal(scores, torch.matmul(query, key.transpose(-1, -2)))
        probs = torch.softmax(scores, -1)
        assert torch.equal(heads_matmul(probs, key), torch.matmul(probs, key))
        output = heads_matmul(probs, key, tokens_major=True)
        assert torch.equal(output, torch.matmul(probs, key))
        if layout == "timm":  # the head-by-head path: (B, H, N, D) over a (B, N, H, D) buffer
            assert output.transpose(1, 2).is_contiguous()


def test_strided_heads_run_head_by_head_and_the_rest_is_matmul(monkeypatch):
    calls = []
    real_bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a, **k: calls.append(1) or real_bmm(*a, **k))
    query, key = _layouts()["timm"]
    with torch.no_grad():
        heads_matmul(query, key.transpose(-1, -2))
    assert len(calls) == H
    calls.clear()
    contiguous = torch.randn(B, H, N, D)
    with torch.no_grad():
        heads_matmul(contiguous, contiguous.transpose(-1, -2))
        heads_matmul(query, key[:1].transpose(-1, -2))                    # broadcast batch: matmul's rules
    leaf = query.clone().requires_grad_()
    result = heads_matmul(leaf, key.transpose(-1, -2))                     # gradients wanted: matmul
    assert calls == [] and result.grad_fn is not None
