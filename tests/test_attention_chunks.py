"""A gradient-free CPU attention runs a few examples at a time (attention_core._attend_in_chunks).

1. Chunked outputs and maps equal the whole-batch ones bit for bit: masks per example and
   broadcast, a head bias, a float32 softmax of bfloat16 scores, an uneven last chunk.
2. Chunks are taken only where they are safe: a scores function marked ``batch_sliceable``,
   no gradients, extras that are sliced or broadcast over the batch.
3. Whole models, one and two examples per chunk: AttentionRollout and GenericAttention maps
   equal the unchunked ones bit for bit on HF BERT (padded), HF ViT (eager, sdpa), Llama
   (grouped-query heads, causal, padded) and timm ViT, and chunks were really taken.
"""
from __future__ import annotations

import pytest
import torch

import captum_transformers as ct
from captum_transformers.propagation.attention import core as attention_core
from captum_transformers.propagation.attention.core import softmax_attention

B, H, Q, K, D = 5, 3, 4, 6, 8


def _sliceable(scores_fn):
    scores_fn.batch_sliceable = True
    return scores_fn


def _operands(dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    packed = torch.randn(B, K, 3, H, D, generator=generator).to(dtype)
    query, key, value = packed.permute(2, 0, 3, 1, 4).unbind(0)  # timm's strided heads
    return query[:, :, :Q], key, value


def _masks():
    padding = torch.zeros(B, 1, 1, K)
    padding[1, ..., -2:] = float("-inf")
    padding[4, ..., -1:] = float("-inf")
    bias = torch.linspace(-1, 1, H * Q * K).reshape(1, H, Q, K)
    causal = torch.zeros(Q, K).masked_fill(torch.ones(Q, K, dtype=torch.bool).triu(3), float("-inf"))
    return padding, bias, causal


@_sliceable
def _scores(query, key, *extras):
    scores = torch.matmul(query * 0.3, key.transpose(-1, -2))
    for extra in extras:
        scores = scores + extra
    return scores


def _whole_and_chunked(monkeypatch, query, key, value, extras, softmax_dtype=None, chunk=2):
    with torch.no_grad():
        monkeypatch.setattr(attention_core, "_CHUNK_BYTES", 2**62)
        whole = softmax_attention(_scores, query, key, value, *extras, softmax_dtype=softmax_dtype)
        chunks = _counting_chunks(monkeypatch, chunk)
        chunked = softmax_attention(_scores, query, key, value, *extras, softmax_dtype=softmax_dtype)
    return whole, chunked, chunks


def _counting_chunks(monkeypatch, chunk):
    """Chunks of ``chunk`` examples wherever chunking is allowed; returns the list of calls."""
    calls = []
    allowed, real = attention_core._examples_per_chunk, attention_core._attend_in_chunks
    monkeypatch.setattr(attention_core, "_CHUNK_BYTES", 1)
    monkeypatch.setattr(attention_core, "_examples_per_chunk", lambda *a: chunk if allowed(*a) else 0)
    monkeypatch.setattr(attention_core, "_attend_in_chunks", lambda *a: calls.append(a[-1]) or real(*a))
    return calls


@pytest.mark.parametrize("chunk", [1, 2, 4])
@pytest.mark.parametrize("extras", ["none", "padding", "bias+padding", "causal"])
def test_chunks_equal_the_whole_batch_bit_for_bit(monkeypatch, chunk, extras):
    padding, bias, causal = _masks()
    chosen = {"none": (), "padding": (padding,), "bias+padding": (bias, padding), "causal": (causal,)}[extras]
    query, key, value = _operands()
    (output, probs), (chunked_output, chunked_probs), calls = _whole_and_chunked(
        monkeypatch, query, key, value, chosen, chunk=chunk)
    assert calls == [chunk]
    assert torch.equal(chunked_output, output) and torch.equal(chunked_probs, probs)
    assert chunked_output.transpose(1, 2).is_contiguous()  # tokens major, as the model reshapes it next


def test_float32_softmax_of_bfloat16_scores(monkeypatch):
    query, key, value = _operands(torch.bfloat16)
    padding = _masks()[0].to(torch.bfloat16)
    (output, probs), (chunked_output, chunked_probs), calls = _whole_and_chunked(
        monkeypatch, query, key, value, (padding,), softmax_dtype=torch.float32)
    assert calls == [2] and chunked_probs.dtype == torch.bfloat16
    assert torch.equal(chunked_output, output) and torch.equal(chunked_probs, probs)


def test_chunks_only_where_safe(monkeypatch):
    query, key, value = _operands()
    padding, bias, causal = _masks()
    monkeypatch.setattr(attention_core, "_CHUNK_BYTES", 1)
    allowed = attention_core._examples_per_chunk

    def unmarked(query, key):
        return torch.matmul(query, key.transpose(-1, -2))

    with torch.no_grad():
        assert allowed(_scores, query, key, value, (causal, bias, padding)) == 1   # broadcast or sliced
        assert allowed(unmarked, query, key, value, ()) == 0            # may read anything per example
        assert allowed(_scores, query, key, value, (padding[:3],)) == 0  # 3 rows for 5 examples
        assert allowed(_scores, query, key, value, (padding[None],)) == 0  # five dimensions
        assert allowed(_scores, query, key[:1], value[:1], ()) == 0      # keys shared by the batch
        monkeypatch.setattr(attention_core, "_CHUNK_BYTES", 2**62)
        assert allowed(_scores, query, key, value, ()) == 0              # one chunk would hold the batch
    monkeypatch.setattr(attention_core, "_CHUNK_BYTES", 1)
    assert allowed(_scores, query, key, value, ()) == 0                  # gradients wanted
    calls = _counting_chunks(monkeypatch, 2)
    leaf = query.detach().clone().requires_grad_()
    output, _ = softmax_attention(_scores, leaf, key, value, padding)  # the Function's forward has no gradients
    assert calls == [2] and output.grad_fn is not None


# --------------------------------------------------------------------------- whole models

def _hf(name, impl):
    from hf_models import CASES

    case = CASES[name]
    inputs, kwargs = case.inputs(batch=3)
    return case.model(impl), inputs, kwargs


def _timm_vit():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.models.vision_transformer.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2,
                                                             num_heads=2, num_classes=5)
    with torch.no_grad():  # away from timm's near-uniform initial attention
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.3)
    return model.eval(), torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1)), {}


MODELS = {
    "bert eager": lambda: _hf("bert", "eager"),
    "vit eager": lambda: _hf("vit", "eager"),
    "vit sdpa": lambda: _hf("vit", "sdpa"),
    "llama sdpa": lambda: _hf("llama_gqa", "sdpa"),
    "timm vit": _timm_vit,
}


@pytest.mark.parametrize("chunk", [1, 2])
@pytest.mark.parametrize("method", ["AttentionRollout", "GenericAttention"])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_model_maps_with_chunks_equal_unchunked(monkeypatch, model_name, method, chunk):
    pytest.importorskip("transformers")
    model, inputs, kwargs = MODELS[model_name]()
    explainer = getattr(ct, method)(model)
    target = None if method == "AttentionRollout" else 1

    def attribute():
        # The dense path, whose kernel runs batch chunks: attribute() streams GenericAttention's rows
        # (tests/test_streaming_rows.py) and replays AttentionRollout's on HF models (tests/test_replayed_rows.py).
        trace = explainer.trace(inputs, target=target, forward_kwargs=kwargs or None)
        return trace.layout.returned(explainer.stream_scores(trace)["tokens"])

    monkeypatch.setattr(attention_core, "_CHUNK_BYTES", 2**62)
    whole = attribute()
    calls = _counting_chunks(monkeypatch, chunk)
    chunked = attribute()
    assert calls and set(calls) == {chunk}
    assert torch.equal(chunked, whole)
    assert whole.abs().sum() > 0
