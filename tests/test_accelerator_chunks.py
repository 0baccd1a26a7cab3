"""What an accelerator runs differently from a CPU in the chunked attention passes, checked on the CPU.

On an accelerator (``device.type != "cpu"``) the chunks of recomputed rows are
``capture.row_chunks.ACCELERATOR_CHUNK_SCALE`` times larger and GenericAttention's head fusion is one
product instead of a loop over heads (one H100, a 1B Llama at 4k tokens: CPU-sized chunks took 16
times longer, launch-bound). The AH rule's backward (``constant_map_attention``) reads how many keys
each block of rows sees in one pass over the mask instead of a host synchronisation per block.
These paths give the CPU paths' values to rounding: here they are forced on the CPU and compared.
"""
from __future__ import annotations

import pytest
import torch

import captum_transformers as ct
from captum_transformers import functional
from captum_transformers.capture import row_chunks
from captum_transformers.propagation.attention import constant_map as cma

F64 = torch.float64


def test_accelerators_get_larger_chunks():
    assert row_chunks.chunk_budget(1000, torch.device("cpu")) == 1000
    scale = row_chunks.ACCELERATOR_CHUNK_SCALE
    assert scale > 1
    assert row_chunks.chunk_budget(1000, torch.device("meta")) == 1000 * scale


def _slow_keys_seen(block, keys):
    """The rule from its definition, one block at a time."""
    if block is None or block.dtype != torch.bool:
        return keys
    rows = block.reshape(-1, block.shape[-1])
    if not bool(rows.any(dim=1).all()):
        return keys  # a fully masked row reads every key
    return int(rows.any(dim=0).nonzero()[-1]) + 1


@pytest.mark.parametrize("shape", [(2, 1, 13, 13), (1, 1, 13, 16), (2, 3, 13, 13), (2, 1, 1, 13)])
@pytest.mark.parametrize("step", [1, 4, 5, 13, 20])
def test_keys_seen_by_block_equal_the_per_block_rule(shape, step):
    generator = torch.Generator().manual_seed(sum(shape) + step)
    queries = 13
    masks = [None, torch.zeros(shape, dtype=F64),
             torch.ones(shape[-2], shape[-1], dtype=torch.bool).tril_().expand(shape).clone()]
    random = torch.rand(shape, generator=generator) < 0.3
    masks.append(random)
    blocked = masks[2].clone()
    blocked[..., min(5, shape[-2] - 1), :] = False  # one fully masked row
    masks.append(blocked)
    for mask in masks:
        found = cma._keys_seen_by_block(mask, queries, shape[-1], step)
        expected = []
        for start in range(0, queries, step):
            block = None if mask is None else (mask[..., start:start + step, :] if mask.shape[-2] > 1 else mask)
            expected.append(_slow_keys_seen(block, shape[-1]))
        assert found == expected, (mask, step)


def test_value_gradient_with_accelerator_sized_blocks_equals_cpu_blocks(monkeypatch):
    torch.manual_seed(0)
    query, key = torch.randn(2, 4, 37, 8, dtype=F64), torch.randn(2, 2, 37, 8, dtype=F64)
    g_output = torch.randn(2, 4, 37, 8, dtype=F64)
    mask = torch.ones(37, 37, dtype=torch.bool).tril_().expand(2, 1, 37, 37).clone()
    mask[1, 0, :, :6] = False  # left padding in the second example
    small = []
    monkeypatch.setattr(cma, "_BLOCK_ELEMENTS", 4 * 2 * 37)  # four rows a block
    small = cma.value_gradient(query, key, mask, 0.3, g_output, value_heads=2)
    monkeypatch.setattr(cma, "chunk_budget", lambda budget, device: budget * 1000)  # one block
    whole = cma.value_gradient(query, key, mask, 0.3, g_output, value_heads=2)
    scores = (query @ key.repeat_interleave(2, 1).transpose(-1, -2) * 0.3).masked_fill(~mask, torch.finfo(F64).min)
    expected = (scores.softmax(-1).transpose(-1, -2) @ g_output).view(2, 2, 2, 37, 8).sum(2)
    torch.testing.assert_close(small, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(whole, expected, rtol=0, atol=1e-12)


def test_fused_head_sum_equals_the_loop_over_heads(monkeypatch):
    """GenericAttention on a padded causal Llama batch: the accelerator's one product over the heads
    gives the CPU loop's map."""
    from hf_models import CASES
    case = CASES["llama_gqa"]
    inputs, kwargs = case.inputs(batch=2, seq=11, dtype=F64)
    model = case.model("sdpa", dtype=F64)
    looped = ct.GenericAttention(model).attribute(inputs, target=1, forward_kwargs=kwargs, return_tokens=True)
    calls = []
    monkeypatch.setattr(functional, "_heads_one_at_a_time", lambda probs, grad: calls.append(1) and False)
    fused = ct.GenericAttention(model).attribute(inputs, target=1, forward_kwargs=kwargs, return_tokens=True)
    assert calls, "the head fusion was not reached"
    torch.testing.assert_close(fused, looped, rtol=0, atol=1e-12)
    assert looped.abs().max() > 1e-3
