"""Streamed explained rows (captum_transformers/capture/row_stream.py) against the dense path.

``attribute`` folds each map into the explained rows during the backward pass where the layout
allows it (one token sequence); ``trace`` + ``reduce`` keeps every map (the dense path). Both
agree to 1e-12 in float64 on batches of 2 (padding in the second text example):

1. every attention method on HF Llama (GQA, causal, padding; eager and sdpa), BERT, ViT, timm
   ViT and Swin, with the map recomputed one query row at a time (the chunked kernels), and the
   stream's decision recorded (streamed on dense layouts, declined on Swin's windows; Grad-CAM
   streams text only, where each row is weighted as its gradient arrives);
2. a map that reaches the stream out of order is kept until its turn (same rows);
3. on a causal model the chunked kernel stops each chunk at its last open key (fewer keys than
   the sequence) and no (B, H, N, N) map is made in the forward pass.
"""
from __future__ import annotations

import pytest
import torch

import captum_transformers as ct
from captum_transformers.functional import gradient_weighted_heads
import captum_transformers.capture.row_chunks as chunking
import captum_transformers.propagation.attention.core as core
from captum_transformers.capture.trace import TokenLayout
from captum_transformers.capture.row_stream import RowStream
from captum_transformers.capture.row_chains import DenseRows, relevance_chain

F64 = torch.float64
METHODS = ["GenericAttention", "TransformerRelevance", "AttentionGradCAM", "RawAttention", "AttentionRollout"]


def _hf(name, impl):
    from hf_models import CASES
    case = CASES[name]
    inputs, kwargs = case.inputs(batch=2, seq=7, dtype=F64)
    return case.model(impl, dtype=F64), inputs, kwargs


def _timm_vit():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.models.vision_transformer.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2,
                                                             num_heads=2, num_classes=5)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.3)
    return model.to(F64).eval(), torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1), dtype=F64), {}


def _swin():
    from swin_models import hf_swin
    return hf_swin(dtype=F64), torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1), dtype=F64), {}


MODELS = {
    "llama eager": lambda: _hf("llama_gqa", "eager"),
    "llama sdpa": lambda: _hf("llama_gqa", "sdpa"),
    "bert sdpa": lambda: _hf("bert", "sdpa"),
    "vit eager": lambda: _hf("vit", "eager"),
    "timm vit": _timm_vit,
    "hf swin": _swin,
}
STREAMED = {"llama eager", "llama sdpa", "bert sdpa", "vit eager", "timm vit"}
IMAGES = {"vit eager", "timm vit", "hf swin"}


@pytest.fixture
def one_row_chunks(monkeypatch):
    """Chunks of one query row, and a count of the chunked backward passes."""
    monkeypatch.setattr(chunking, "ROW_CHUNK_BYTES", 1)
    calls = []
    chunked = core._plain_backward_in_row_chunks

    def counted(*args, **kwargs):
        calls.append(1)
        return chunked(*args, **kwargs)

    monkeypatch.setattr(core, "_plain_backward_in_row_chunks", counted)
    return calls


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("method_name", METHODS)
def test_streamed_rows_equal_the_dense_path(model_name, method_name, one_row_chunks):
    model, inputs, kwargs = MODELS[model_name]()
    method = getattr(ct, method_name)(model)
    streamed = method.attribute(inputs, target=1, forward_kwargs=kwargs, return_tokens=True)
    stream, chunked = getattr(method, "_row_stream", None), len(one_row_chunks)
    trace = method.trace(inputs, target=1, forward_kwargs=kwargs)
    dense = method.stream_scores(trace)["tokens"]
    assert streamed.dtype == F64 and torch.isfinite(streamed).all()
    torch.testing.assert_close(streamed, trace.layout.returned(dense), rtol=0, atol=1e-12)
    if method_name != "AttentionGradCAM":  # rectified: may be all zero on a random model
        assert streamed.abs().max() > 1e-3  # not a trivially equal zero map
    if method_name in ("GenericAttention", "TransformerRelevance"):
        assert stream.streamed == (model_name in STREAMED), stream.reason
        assert bool(chunked) == (model_name in STREAMED), "chunks of rows where (and only where) rows stream"
    if method_name == "AttentionGradCAM":  # weighted per row as the gradient arrives: text only
        text = model_name in STREAMED - IMAGES
        assert (stream is not None and stream.streamed) == text and bool(chunked) == text
    if model_name == "hf swin" and method_name in ("GenericAttention", "TransformerRelevance"):
        assert "windowed" in stream.reason


def fake_recorder(layout, calls: int):
    """What RowStream reads of a recorder: one token sequence, ``calls`` self-attention calls, one
    backward pass reduced by GenericAttention's (row-separable) reduction."""
    return type("Recorder", (), {"streams": ct.StreamLayouts.single(layout, 1),
                                 "sites": [type("Site", (), {"streams": ("tokens", "tokens")})()] * calls,
                                 "spec": ct.CaptureSpec(backward_reduce=gradient_weighted_heads),
                                 "keep_probs": False, "first_spec": None, "pairs_passes": False})()


def test_an_out_of_order_map_waits_for_its_turn():
    generator = torch.Generator().manual_seed(0)
    maps = [torch.rand(2, 5, 5, generator=generator, dtype=F64) for _ in range(3)]
    layout = TokenLayout(5, torch.tensor([[4], [3]]))
    expected = relevance_chain(DenseRows(layout), maps)

    stream = RowStream()
    assert stream.accepts(fake_recorder(layout, calls=3))
    stream.fold(1, maps[1])                       # early: kept whole
    stream.fold_rows(2, slice(0, 3), maps[2][:, :3])
    stream.fold_rows(2, slice(3, 5), maps[2][:, 3:])
    stream.finish(2)                              # folds call 2, then the waiting call 1
    stream.fold_rows(0, slice(0, 5), maps[0][:, :, :4])  # keys after the 4th: zero in this chunk
    maps[0][:, :, 4:] = 0
    stream.finish(0)
    torch.testing.assert_close(stream.result(), relevance_chain(DenseRows(layout), maps), rtol=0, atol=1e-12)
    assert not torch.equal(expected, stream.result())


def test_an_incomplete_stream_is_refused():
    layout = TokenLayout(3, torch.tensor([[2]]))

    stream = RowStream()
    stream.accepts(fake_recorder(layout, calls=2))
    stream.fold(1, torch.eye(3, dtype=F64)[None])
    with pytest.raises(ct.CaptureError, match="call 0"):
        stream.result()


def test_causal_chunks_stop_at_their_last_key_and_no_map_is_made(monkeypatch):
    model, inputs, kwargs = _hf("llama_gqa", "sdpa")
    monkeypatch.setattr(chunking, "ROW_CHUNK_BYTES", 1)
    widths, shapes = [], []
    rows = core.row_chunks

    def seen(*args):
        for chunk in rows(*args):
            widths.append((chunk[0].stop, chunk[5]))
            yield chunk

    monkeypatch.setattr(core, "row_chunks", seen)
    softmax = torch.softmax

    def watched(tensor, *args, **kwargs):
        shapes.append(tuple(tensor.shape))
        return softmax(tensor, *args, **kwargs)

    monkeypatch.setattr(torch, "softmax", watched)
    ct.GenericAttention(model).attribute(inputs, target=1, forward_kwargs=kwargs, return_tokens=True)
    assert widths and all(keys == stop for stop, keys in widths)  # row q attends to keys 0..q
    assert all(shape[-2] == 1 for shape in shapes if len(shape) == 4), shapes


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_no_per_head_map_is_saved_for_the_backward_pass(impl):
    """Streamed: autograd saves no (B, H, N, N) tensor (a mask shared by the layers has one head)."""
    model, inputs, kwargs = _hf("llama_gqa", impl)
    tokens = inputs.shape[1]
    saved = []

    def pack(tensor):
        saved.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        ct.GenericAttention(model).attribute(inputs, target=1, forward_kwargs=kwargs, return_tokens=True)
    per_head_maps = [s for s in saved if len(s) == 4 and s[1] > 1 and s[-2:] == (tokens, tokens)]
    assert saved and not per_head_maps, per_head_maps
    if impl == "eager":  # the check can fail: the model's own eager attention saves per-head maps
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(inputs, **kwargs)
        assert [s for s in saved if len(s) == 4 and s[1] > 1 and s[-2:] == (tokens, tokens)]


def _returned_attentions(model):
    """A hook on the whole model (not an attention module): the attentions its output carries."""
    seen = []
    handle = model.register_forward_hook(lambda module, args, output: seen.append(output.attentions))
    return seen, handle


@pytest.mark.parametrize("request_by", ["forward_kwargs", "config"])
def test_requested_attention_weights_decline_the_stream(request_by):
    """output_attentions=True: the kernels return the real weights (the model's own, not a zero
    stand-in), the stream declines with its reason, and the map is the dense path's."""
    model, inputs, kwargs = _hf("llama_gqa", "eager")
    if request_by == "config":
        model.config.output_attentions = True
    else:
        kwargs = {**kwargs, "output_attentions": True}
    with torch.no_grad():
        expected = model(inputs, **kwargs).attentions
    assert expected is not None and len(expected) == model.config.num_hidden_layers
    seen, handle = _returned_attentions(model)
    method = ct.GenericAttention(model)
    try:
        scores = method.attribute(inputs, target=1, forward_kwargs=kwargs, return_tokens=True)
    finally:
        handle.remove()
    stream = method._row_stream
    assert stream.streamed is False and "output_attentions" in stream.reason, stream.reason
    assert len(seen) == 1 and len(seen[0]) == len(expected)
    for returned, own in zip(seen[0], expected):
        assert returned.abs().max() > 0.1  # not the zero stand-in
        # HF's eager softmax runs in float32, the package's in the model's float64
        torch.testing.assert_close(returned.detach(), own, rtol=0, atol=1e-6)
    trace = method.trace(inputs, target=1, forward_kwargs=kwargs)
    torch.testing.assert_close(scores, trace.layout.returned(method.stream_scores(trace)["tokens"]), rtol=0,
                               atol=1e-12)


def test_a_hook_on_an_attention_module_declines_the_stream():
    """A user's forward hook on an attention module may read its weights: they are the real map."""
    model, inputs, kwargs = _hf("llama_gqa", "eager")
    seen = []
    attention = model.model.layers[0].self_attn
    handle = attention.register_forward_hook(lambda module, args, output: seen.append(output[1]))
    method = ct.GenericAttention(model)
    try:
        method.attribute(inputs, target=1, forward_kwargs=kwargs, return_tokens=True)
    finally:
        handle.remove()
    assert method._row_stream.streamed is False and "forward hook" in method._row_stream.reason
    with torch.no_grad():
        own = model(inputs, **kwargs, output_attentions=True).attentions[0]
    torch.testing.assert_close(seen[0].detach(), own, rtol=0, atol=1e-6)
    streamed = ct.GenericAttention(model)  # the hook removed: the stream runs again
    streamed.attribute(inputs, target=1, forward_kwargs=kwargs, return_tokens=True)
    assert streamed._row_stream.streamed, streamed._row_stream.reason


def test_a_model_that_reads_streamed_weights_fails_loudly():
    """Weights read with no hook or output_attentions to announce it (a module using them): the
    stand-in refuses every operation but its shape, so nothing reads zeros for a map."""
    model, inputs, kwargs = _hf("llama_gqa", "eager")
    attention = model.model.layers[0].self_attn
    own_forward, shapes = attention.forward, []

    def reading(*args, read=True, **kw):
        output, weights = own_forward(*args, **kw)
        shapes.append(tuple(weights.shape))
        return output + 0 * weights.sum() if read else output, weights

    attention.forward = reading
    with pytest.raises(ct.CaptureError, match="output_attentions=True"):
        ct.GenericAttention(model).attribute(inputs, target=1, forward_kwargs=kwargs, return_tokens=True)
    attention.forward = lambda *args, **kw: reading(*args, read=False, **kw)
    method = ct.GenericAttention(model)
    method.attribute(inputs, target=1, forward_kwargs=kwargs, return_tokens=True)
    assert method._row_stream.streamed and shapes[-1] == (2, 4, 7, 7)
