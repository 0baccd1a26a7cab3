"""TransformerRelevance's two passes and Grad-CAM's last map, streamed into the explained rows.

TransformerRelevance (CVPR'21) pairs each map's LRP relevance (a first backward pass under the
rules) with its plain gradient (a second pass through the same graph). Streamed
(``RowStream(paired=True)``), the first pass runs a few query rows at a time under the rules
(``propagation/row_chunked_rules.py``) and the second hands both gradients per chunk; Grad-CAM
(``RowStream(last_only=True)``) folds only the last call's rows, and the earlier calls are
differentiated in chunks too. Checked here, beyond the equality of every method in
``test_streaming_rows.py``: equal to the dense path relative to the maps' own small entries, no
whole map made in any pass, and the cases that keep the dense path, with their reasons.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import captum_transformers as ct
from captum_transformers.functional import gradient_weighted_heads
import captum_transformers.capture.row_chunks as chunking
import captum_transformers.propagation.attention.core as core
import captum_transformers.propagation.attention.row_chunked_rules as chunked_rules

F64 = torch.float64


def _llama(impl="sdpa"):
    from hf_models import CASES
    case = CASES["llama_gqa"]
    inputs, kwargs = case.inputs(batch=2, seq=7, dtype=F64)
    return case.model(impl, dtype=F64), inputs, kwargs


def _dense(method, inputs, kwargs):
    trace = method.trace(inputs, target=1, forward_kwargs=kwargs)
    return trace.layout.returned(method.stream_scores(trace)["tokens"])


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("start_layer", [0, 1])
def test_paired_stream_equals_the_dense_pair_in_every_entry(impl, start_layer, monkeypatch):
    """Relative to each entry (most are ~1e-5 next to the explained token's ~1): a chunk paired
    with the wrong rows, or a missed halving, moves them by far more than rounding."""
    monkeypatch.setattr(chunking, "ROW_CHUNK_BYTES", 1)
    rules_passes = []
    original = chunked_rules.rules_backward_in_row_chunks

    def counted(*args):
        rules_passes.append(1)
        return original(*args)

    monkeypatch.setattr(chunked_rules, "rules_backward_in_row_chunks", counted)
    model, inputs, kwargs = _llama(impl)
    method = ct.TransformerRelevance(model, start_layer=start_layer)
    streamed = method.attribute(inputs, target=1, forward_kwargs=kwargs, return_tokens=True)
    assert method._row_stream.streamed and method._row_stream.paired
    assert len(rules_passes) == 2  # both layers' relevance passes ran in chunks of rows
    dense = _dense(method, inputs, kwargs)
    torch.testing.assert_close(streamed, dense, rtol=1e-10, atol=1e-16)
    assert (dense[dense < 0.5] > 1e-7).any()  # the small entries the check is about are there


@pytest.mark.parametrize("method_name", ["TransformerRelevance", "AttentionGradCAM"])
def test_no_whole_map_is_made_in_any_pass(method_name, monkeypatch):
    model, inputs, kwargs = _llama("sdpa")
    monkeypatch.setattr(chunking, "ROW_CHUNK_BYTES", 1)
    shapes = []
    softmax = torch.softmax

    def watched(tensor, *args, **kw):
        shapes.append(tuple(tensor.shape))
        return softmax(tensor, *args, **kw)

    monkeypatch.setattr(torch, "softmax", watched)
    getattr(ct, method_name)(model).attribute(inputs, target=1, forward_kwargs=kwargs, return_tokens=True)
    maps = [shape for shape in shapes if len(shape) == 4]
    assert maps and all(shape[-2] == 1 for shape in maps), maps


def test_grad_cam_streams_text_and_equals_dense_rows(monkeypatch):
    monkeypatch.setattr(chunking, "ROW_CHUNK_BYTES", 1)
    from hf_models import CASES
    case = CASES["bert"]
    inputs, kwargs = case.inputs(batch=2, seq=7, dtype=F64)
    model = case.model("sdpa", dtype=F64)
    method = ct.AttentionGradCAM(model)
    streamed = method.attribute(inputs, target=1, forward_kwargs=kwargs, return_tokens=True)
    assert method._row_stream.streamed and method._row_stream.last_only
    dense = _dense(method, inputs, kwargs)
    torch.testing.assert_close(streamed, dense, rtol=1e-10, atol=1e-18)
    assert dense.abs().max() > 0


@pytest.mark.parametrize("method, why", [
    (lambda m: ct.TransformerRelevance(m, row_normalize=True), "rownorm(I + Abar) is not a row update"),
    (lambda m: ct.AttentionGradCAM(m, head_weights="all"), "weights over every row: known after the last chunk"),
])
def test_methods_that_need_whole_maps_keep_the_dense_path(method, why):
    model, inputs, kwargs = _llama("sdpa")
    explainer = method(model)
    scores = explainer.attribute(inputs, target=1, forward_kwargs=kwargs, return_tokens=True)
    assert explainer._row_stream is None, why
    torch.testing.assert_close(scores, _dense(explainer, inputs, kwargs), rtol=0, atol=0)


def test_a_paired_stream_declines_a_single_pass():
    """A paired stream given one backward pass (no relevance to pair with) declines, never folds."""
    from captum_transformers.capture.trace import TokenLayout
    from captum_transformers.capture.row_stream import RowStream
    layout = TokenLayout(3, torch.tensor([[2]]))

    from test_streaming_rows import fake_recorder
    stream = RowStream(paired=True)
    assert not stream.accepts(fake_recorder(layout, calls=2)) and "two backward passes" in stream.reason


def test_a_subclass_reduction_not_marked_row_separable_keeps_the_dense_path():
    """A subclass may reduce each map across its rows (here: every row divided by the map's total);
    chunks of rows would change that silently, so the stream declines and the map is the dense one."""
    class WholeMapNormalized(ct.GenericAttention):
        def capture_spec(self):
            spec = super().capture_spec()

            def normalized(probs, grad, valid=None):
                value = gradient_weighted_heads(probs, grad, valid)
                return value / value.sum(dim=(-2, -1), keepdim=True).clamp_min(1e-30)

            return dataclasses.replace(spec, backward_reduce=normalized)

    model, inputs, kwargs = _llama("sdpa")
    method = WholeMapNormalized(model)
    scores = method.attribute(inputs, target=1, forward_kwargs=kwargs, return_tokens=True)
    assert method._row_stream.streamed is False and "row_separable" in method._row_stream.reason
    torch.testing.assert_close(scores, _dense(method, inputs, kwargs), rtol=0, atol=0)


def test_rows_left_by_attribute_are_not_read_for_a_later_dense_trace():
    model, inputs, kwargs = _llama("sdpa")
    method = ct.GenericAttention(model)
    trace = method.trace(inputs, target=1, forward_kwargs=kwargs)
    dense = method.stream_scores(trace)
    method.attribute(inputs, target=0, forward_kwargs=kwargs, return_tokens=True)  # other rows, left behind
    assert method._row_stream.streamed
    again = method.stream_scores(trace)
    torch.testing.assert_close(again["tokens"], dense["tokens"], rtol=0, atol=0)


def test_a_failed_attribute_drops_its_rows():
    model, inputs, kwargs = _llama("sdpa")
    method = ct.GenericAttention(model, start_layer=5)  # past the 2 layers: refused after the passes
    with pytest.raises(ct.InputError):
        method.attribute(inputs, target=1, forward_kwargs=kwargs, return_tokens=True)
    assert method._row_stream is None


def test_grad_cam_keeps_every_key_where_a_mask_not_the_module_makes_it_causal(monkeypatch):
    """CLIP's text tower: causal through its mask, ``is_causal=False`` on the module. The dense
    Grad-CAM averages the gradient over every real key of the row, past the causal cut too (the
    map is 0 there, its gradient is not): the streamed chunks must not stop at the row's last open key."""
    from hf_models import CASES
    case = CASES["clip_text"]
    model = case.model("eager", dtype=F64)
    ids, kwargs = case.inputs(batch=1, seq=9)
    ids[0, -1], ids[0, 4] = 5, 98  # the explained EOS in the middle: real tokens after it
    monkeypatch.setattr(chunking, "ROW_CHUNK_BYTES", 1)
    method = ct.AttentionGradCAM(model)
    streamed = method.attribute(ids, target=1, forward_kwargs=kwargs, return_tokens=True)
    assert method._row_stream.streamed
    dense = _dense(method, ids, kwargs)
    torch.testing.assert_close(streamed, dense, rtol=1e-10, atol=1e-18)
    assert dense.abs().max() > 0


@pytest.mark.parametrize("method_name", ["GenericAttention", "TransformerRelevance"])
def test_a_layer_the_score_does_not_read_is_folded_without_a_whole_zero_map(method_name, monkeypatch):
    """The explained logit read after the first layer: the second layer gets a zero gradient,
    reduced a chunk of rows at a time (no (B, H, N, N) zeros) and equal to the dense path."""
    model, inputs, kwargs = _llama("sdpa")
    monkeypatch.setattr(chunking, "ROW_CHUNK_BYTES", 1)
    monkeypatch.setattr("captum_transformers.capture.recorder._ZERO_CHUNK_BYTES", 1)
    second = model.model.layers[1]
    handle = second.register_forward_hook(lambda module, args, output: (args[0] * 1.0,) + tuple(output[1:])
                                          if isinstance(output, tuple) else args[0] * 1.0)
    zeros, original = [], torch.zeros

    def counted(*size, **kw):
        shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else tuple(size)
        if len(shape) == 4 and shape[-2] > 1 and shape[-2] == shape[-1]:
            zeros.append(shape)
        return original(*size, **kw)

    try:
        method = getattr(ct, method_name)(model)
        monkeypatch.setattr(torch, "zeros", counted)
        streamed = method.attribute(inputs, target=1, forward_kwargs=kwargs, return_tokens=True)
        monkeypatch.setattr(torch, "zeros", original)
        assert method._row_stream.streamed and not zeros, zeros
        torch.testing.assert_close(streamed, _dense(method, inputs, kwargs), rtol=1e-10, atol=1e-16)
    finally:
        handle.remove()


@pytest.mark.parametrize("method_name", ["TransformerRelevance", "AttentionGradCAM", "GenericAttention"])
def test_streamed_sdpa_models_keep_sdpa_masks_under_the_rules_too(method_name, monkeypatch):
    """Unpadded causal sdpa Llama: the capture and, inside it, TransformerRelevance's rule context
    run under SDPA's masks, so the causal mask is the package's own boolean one (never read) and
    transformers builds no additive float (B, 1, N, N) mask (64 MiB at 4k tokens)."""
    from captum_transformers.adapters.huggingface import kernel_rows as hf_rows
    model, inputs, kwargs = _llama("sdpa")
    kwargs = {"attention_mask": torch.ones_like(kwargs["attention_mask"])}
    reads = []  # an additive eager mask would be read once (is it causal?); SDPA's own one is known
    reads_causal = hf_rows._reads_causal
    monkeypatch.setattr(hf_rows, "_reads_causal", lambda *a, **k: reads.append(1) or reads_causal(*a, **k))
    method = getattr(ct, method_name)(model)
    method.attribute(inputs, target=1, forward_kwargs=kwargs, return_tokens=True)
    assert method._row_stream.streamed and not reads, reads
