"""Generated tokens explained with streamed rows: one row stream per explained group.

``GenerationAttribution`` explains every step from one forward pass, one backward pass (two for
TransformerRelevance) per explained group. GenericAttention, TransformerRelevance and Grad-CAM
fold each group's maps into a fresh ``RowStream`` (``generation/engine.py``), so no per-layer map is
kept across the steps. Checked: equal to the same generation with the streams turned off (the
dense maps) to 1e-12 in float64, per step and per earlier output; every group streamed; no whole
(B, H, N, N) map made; the batch of unequal prompts; an encoder-decoder model keeps the dense path.
"""
from __future__ import annotations

import pytest
import torch
from generation_models import IdTokenizer, build

import captum_transformers.generation.engine as engine
import captum_transformers.capture.row_chunks as chunking
import captum_transformers.propagation.attention.core as core
from captum_transformers import AttentionGradCAM, GenericAttention, TransformerRelevance
from captum_transformers.generation import GenerationAttribution

pytest.importorskip("transformers")
METHODS = {"GenericAttention": GenericAttention, "TransformerRelevance": TransformerRelevance,
           "AttentionGradCAM": AttentionGradCAM}
PROMPTS, TARGETS = [[1, 5, 7, 9, 11, 13], [1, 6, 8]], [[20, 21, 22], [23, 24]]


def _explain(method, streamed: bool, monkeypatch, prompts=PROMPTS, targets=TARGETS):
    if not streamed:
        monkeypatch.setattr(engine, "streamed_pass_plan", lambda m, inputs, kwargs: m.pass_plan(inputs, (), kwargs))
    try:
        return GenerationAttribution(method, IdTokenizer()).attribute(prompts, target=targets)
    finally:
        monkeypatch.undo()


def _seen_streams(monkeypatch):
    """Every group's row stream, as the engine hands it to the method."""
    seen = []
    trace_steps = engine.trace_steps

    def watched(*args):
        *rest, on_step = args
        return trace_steps(*rest, lambda g, trace: seen.append(trace.row_stream) or on_step(g, trace))

    monkeypatch.setattr("captum_transformers.generation.attribution.trace_steps", watched)
    return seen


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name", list(METHODS))
def test_streamed_steps_equal_the_dense_steps(name, impl, monkeypatch):
    model = build("llama", impl)
    method = METHODS[name](model)
    dense = _explain(method, streamed=False, monkeypatch=monkeypatch)
    monkeypatch.setattr(chunking, "ROW_CHUNK_BYTES", 1)
    streams = _seen_streams(monkeypatch)
    streamed = GenerationAttribution(method, IdTokenizer()).attribute(PROMPTS, target=TARGETS)
    assert streams and all(stream is not None and stream.streamed for stream in streams), \
        [getattr(s, "reason", None) for s in streams]
    for got, want in zip(streamed, dense):
        torch.testing.assert_close(got.token_attr, want.token_attr, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(got.target_attr, want.target_attr, rtol=1e-10, atol=1e-12)
    if name != "AttentionGradCAM":  # rectified: may be all zero on a random model
        assert max(float(r.token_attr.abs().max()) for r in dense) > 1e-3


def test_no_whole_map_is_made_across_the_steps(monkeypatch):
    model = build("llama", "sdpa")
    monkeypatch.setattr(chunking, "ROW_CHUNK_BYTES", 1)
    shapes, softmax = [], torch.softmax

    def watched(tensor, *args, **kwargs):
        shapes.append(tuple(tensor.shape))
        return softmax(tensor, *args, **kwargs)

    monkeypatch.setattr(torch, "softmax", watched)
    GenerationAttribution(TransformerRelevance(model), IdTokenizer()).attribute(PROMPTS[0], target=TARGETS[0])
    maps = [shape for shape in shapes if len(shape) == 4]
    assert maps and all(shape[-2] == 1 for shape in maps), maps


def test_an_encoder_decoder_keeps_the_dense_path(monkeypatch):
    model = build("bart")
    streams = _seen_streams(monkeypatch)
    GenerationAttribution(GenericAttention(model), IdTokenizer()).attribute(PROMPTS[0], target=TARGETS[0])
    assert streams and all(s is not None and s.streamed is False and "several token streams" in s.reason
                           for s in streams)
