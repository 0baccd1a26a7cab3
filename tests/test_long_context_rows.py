"""GenericAttention's streamed kernel at long causal contexts (adapters/hf_rows.py, the chunked backward
of propagation/attention_core.py): faster, with the same results to rounding.

1. On an unpadded causal Llama (eager and sdpa, grouped-query heads, float64) the streamed forward runs
   SDPA's fused kernel (once per layer), the mask is read once per forward pass, each chunk of rows
   stops at its last key read from its place in the mask, and the explained rows equal the dense
   path's to 1e-12; with padding the kernel falls back to the explicit operations (same equality).
2. The causal-mask check accepts exactly the upper-left causal masks (boolean and additive) and
   refuses any changed entry, a blocked entry not low enough, a NaN, and a mask changed in place.
3. Keys needed from a chunk's place equal those read from its values; masking only the tail of a
   causal chunk gives the scores bit for bit; the fused output equals the explicit one (and declines
   half precision, other masks, a position bias); ``add_product`` and the head-at-a-time
   ``gradient_weighted_heads`` equal their formulas; chunk buffers are reused.
"""
from __future__ import annotations

import pytest
import torch

import captum_transformers as ct
import captum_transformers.capture.row_chunks as chunking
import captum_transformers.propagation.attention.core as core
from captum_transformers.adapters.huggingface import kernel_rows as hf_rows
from captum_transformers.propagation.attention import chunk_products
from captum_transformers import functional

F64 = torch.float64


def _llama(impl, padded):
    from hf_models import CASES
    case = CASES["llama_gqa"]
    inputs, kwargs = case.inputs(batch=2, seq=11, dtype=F64)
    if not padded:
        kwargs = {"attention_mask": torch.ones_like(kwargs["attention_mask"])}
    return case.model(impl, dtype=F64), inputs, kwargs


def _additive_causal(num_queries, num_keys, dtype=torch.float32, batch=1):
    blocked = ~torch.ones(num_queries, num_keys, dtype=torch.bool).tril_()
    return torch.zeros(batch, 1, num_queries, num_keys, dtype=dtype).masked_fill_(blocked, torch.finfo(dtype).min)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("padded", [False, True])
def test_streamed_rows_on_a_causal_model_equal_the_dense_path(monkeypatch, impl, padded):
    model, inputs, kwargs = _llama(impl, padded)
    monkeypatch.setattr(chunking, "ROW_CHUNK_BYTES", 1)  # chunks of one query row
    fused, reads, widths = [], [], []
    sdpa, reads_causal, row_chunks = (torch.nn.functional.scaled_dot_product_attention, hf_rows._reads_causal,
                                      core.row_chunks)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: fused.append(k.get("is_causal")) or sdpa(*a, **k))
    monkeypatch.setattr(hf_rows, "_reads_causal", lambda *a, **k: reads.append(1) or reads_causal(*a, **k))

    def seen(*args):
        for chunk in row_chunks(*args):
            widths.append((chunk[0].stop, chunk[5]))
            yield chunk

    monkeypatch.setattr(core, "row_chunks", seen)
    method = ct.GenericAttention(model)
    streamed = method.attribute(inputs, target=1, forward_kwargs=kwargs, return_tokens=True)
    assert method._row_stream.streamed, method._row_stream.reason
    layers = model.config.num_hidden_layers
    assert fused == ([] if padded else [True] * layers)  # the fused forward only where it gives the same
    # eager: the first layer reads transformers' mask (causal or not), the others reuse the answer; sdpa
    # streams under SDPA's masks: the unpadded causal mask is the package's own, known without reading.
    assert len(reads) == (0 if impl == "sdpa" and not padded else 1)
    assert widths and all(keys == stop for stop, keys in widths)  # row q attends to keys 0..q
    trace = method.trace(inputs, target=1, forward_kwargs=kwargs)
    dense = trace.layout.returned(method.stream_scores(trace)["tokens"])
    torch.testing.assert_close(streamed, dense, rtol=0, atol=1e-12)
    assert streamed.abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, F64, torch.bool])
def test_the_causal_check_accepts_exactly_the_causal_mask(dtype):
    def mask(num_queries=9, num_keys=9, batch=2):
        if dtype == torch.bool:
            return torch.ones(num_queries, num_keys, dtype=torch.bool).tril_().expand(batch, 1, -1, -1).clone()
        return _additive_causal(num_queries, num_keys, dtype, batch)

    for shape in [(9, 9), (5, 9), (9, 5)]:  # upper-left aligned, as SDPA's is_causal
        assert hf_rows._reads_causal(mask(*shape), block=4)
    lowest = False if dtype == torch.bool else torch.finfo(dtype).min
    opened = True if dtype == torch.bool else 0.0
    changes = [((1, 0, 6, 7), opened), ((0, 0, 8, 0), lowest), ((1, 0, 3, 3), lowest)]
    if dtype != torch.bool:
        changes += [((0, 0, 2, 5), -1e30), ((0, 0, 4, 1), float("nan")), ((0, 0, 4, 1), -1e-30)]
    for where, value in changes:
        changed = mask()
        changed[where] = value
        assert not hf_rows._reads_causal(changed, block=4), (where, value)
        assert not hf_rows.is_causal_mask(changed)
    kept = mask()
    assert hf_rows.is_causal_mask(kept) and hf_rows.is_causal_mask(kept[:, :, :, :9])
    kept[0, 0, 0, 5] = opened  # changed in place after a read: read again
    assert not hf_rows.is_causal_mask(kept)


def test_a_made_causal_mask_is_shared_and_known_without_reading(monkeypatch):
    made = hf_rows.causal_mask(6, 6, torch.device("cpu"))
    assert made is hf_rows.causal_mask(6, 6, torch.device("cpu"))
    assert torch.equal(made[0, 0], torch.ones(6, 6, dtype=torch.bool).tril())
    monkeypatch.setattr(hf_rows, "_reads_causal", lambda *a, **k: pytest.fail("read a mask it made"))
    assert hf_rows.is_causal_mask(made) and hf_rows.is_causal_mask(made[..., :6])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("boolean", [True, False])
def test_keys_and_masked_tail_from_a_chunks_place(causal, boolean):
    num_queries = num_keys = 10
    mask = _additive_causal(num_queries, num_keys, F64, batch=2)
    if not causal:
        mask[1, 0, 2, 1] = torch.finfo(F64).min  # a padding-like hole: read from the values
        mask[0, 0, 7, 9] = 0.0
    if boolean:
        mask = mask == 0
    needed = hf_rows.keys_needed_of(mask)
    scores = torch.randn(2, 3, num_queries, num_keys, dtype=F64, generator=torch.Generator().manual_seed(0))
    for start, stop in [(0, 3), (3, 4), (4, 8), (8, 10)]:
        rows = mask[..., start:stop, :]
        keys = needed(rows)
        assert keys == hf_rows.keys_needed(rows)
        cut = rows[..., :keys]
        tail = hf_rows.masked_from(mask, cut)
        assert tail == (min(start + 1, keys) if causal and start else 0)
        whole, part = scores[..., start:stop, :keys].clone(), scores[..., start:stop, :keys].clone()
        if boolean:
            whole.masked_fill_(~cut, torch.finfo(F64).min)
            part[..., tail:].masked_fill_(~cut[..., tail:], torch.finfo(F64).min)
        else:
            whole.add_(cut)
            part[..., tail:].add_(cut[..., tail:])
        assert torch.equal(whole, part)


def _explicit(query, key, value, mask, scaling):
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if mask is not None:
        scores = scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1), value)


@pytest.mark.parametrize("dtype,tolerance", [(F64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("masked", [True, False])
def test_the_fused_output_equals_the_explicit_one(dtype, tolerance, masked):
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 4, 7, 8, generator=generator, dtype=dtype) for _ in range(3))
    mask = _additive_causal(7, 7, dtype) if masked else None
    fused = hf_rows.fused_output(mask, 0.3, plain=True)(query, key, value, *([mask] if masked else []))
    torch.testing.assert_close(fused, _explicit(query, key, value, mask, 0.3), rtol=0, atol=tolerance)


def test_the_fused_output_declines_what_it_would_change():
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 2, 5, 4, generator=generator) for _ in range(3))
    assert hf_rows.fused_output(None, 0.5, plain=False) is None  # a position bias or soft-capping
    padded = _additive_causal(5, 5)
    padded[..., 3] = torch.finfo(torch.float32).min  # a padded key
    assert hf_rows.fused_output(padded, 0.5, plain=True)(query, key, value, padded) is None
    causal = _additive_causal(5, 5)
    half = [t.to(torch.bfloat16) for t in (query, key, value)]
    assert hf_rows.fused_output(causal, 0.5, plain=True)(*half, causal) is None
    one_query = query[..., :1, :]
    assert hf_rows.fused_output(causal[..., :1, :], 0.5, plain=True)(one_query, key, value, causal) is None


@pytest.mark.parametrize("alpha", [1.0, 0.25])
@pytest.mark.parametrize("folds", [True, False])
def test_add_product_sums_in_place(alpha, folds):
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 3, 4, 5, generator=generator, dtype=F64), torch.randn(2, 3, 5, 6, generator=generator,
                                                                                  dtype=F64)
    base = torch.randn(2, 3, 9, 6, generator=generator, dtype=F64)
    # A slice of rows folds its heads into one batch; a slice of heads of a (B, N, H, D) layout does not.
    out = base[:, :, 2:6] if folds else base.transpose(1, 2).contiguous().transpose(1, 2)[:, :, 2:6]
    expected = out + alpha * torch.matmul(a, b)
    returned = chunk_products.add_product(out, a, b, alpha=alpha)
    assert returned is out
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [F64, torch.float16])
def test_gradient_weighted_heads_one_head_at_a_time(dtype):
    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(2, 5, 3, 4, generator=generator).to(dtype)
    grad = torch.randn(2, 5, 3, 4, generator=generator).to(dtype)
    expected = (grad.double() * probs.double()).clamp(min=0).mean(dim=1)
    reduced = functional.gradient_weighted_heads(probs, grad)
    assert reduced.dtype == torch.promote_types(dtype, torch.float32)
    torch.testing.assert_close(reduced.double(), expected, rtol=0, atol=1e-12 if dtype == F64 else 1e-6)
    leaf = probs.double().requires_grad_(True)  # with a graph to record: the product, differentiable
    functional.gradient_weighted_heads(leaf, grad.double()).sum().backward()
    assert leaf.grad is not None and not functional.gradient_weighted_heads.reads_valid
    one = functional.gradient_weighted_heads(torch.tensor([[[[.5, .5]]]]), torch.tensor([[[[2., -4.]]]]))
    assert torch.equal(one, torch.tensor([[[1., 0.]]]))


def test_chunk_buffers_are_reused_and_grown():
    buffers, like = chunk_products.ChunkBuffers(), torch.zeros((), dtype=F64)
    first = buffers.take(0, (1, 2, 3, 4), like)
    smaller = buffers.take(0, (1, 2, 3, 2), like)
    assert smaller.data_ptr() == first.data_ptr() and smaller.is_contiguous() and smaller.shape == (1, 2, 3, 2)
    larger = buffers.take(0, (1, 2, 3, 5), like)
    assert larger.shape == (1, 2, 3, 5) and larger.numel() == 30
    assert buffers.take(1, (2, 2), like).data_ptr() != larger.data_ptr()


def test_each_device_keeps_its_shared_causal_mask():
    """A model spread over devices asks for the causal mask on each layer's device in turn: each
    device keeps its own (before, every change of device made a new mask, one per layer)."""
    on_cpu = hf_rows.causal_mask(5, 5, torch.device("cpu"))
    on_meta = hf_rows.causal_mask(5, 5, torch.device("meta"))
    assert hf_rows.causal_mask(5, 5, torch.device("cpu")) is on_cpu
    assert hf_rows.causal_mask(5, 5, torch.device("meta")) is on_meta
    other = hf_rows.causal_mask(6, 6, torch.device("cpu"))  # another length: the old shape is let go
    assert hf_rows.causal_mask(6, 6, torch.device("cpu")) is other
    assert (5, 5, torch.device("cpu")) not in hf_rows._LATEST
