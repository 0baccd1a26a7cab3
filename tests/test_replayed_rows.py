"""Replayed rows (captum_transformers/capture/replayed_rows.py) against the dense path.

In ``attribute``, AttentionRollout and RawAttention keep what recomputes each call's map (Q, K,
the mask, the scores function) instead of the map, and replay the calls after the forward pass,
one chunk of query rows at a time; ``trace`` + ``stream_scores`` keeps every map (the dense
path). On batches of 2 (padding in the second text example), in float64:

1. both agree to 1e-12 on HF Llama (GQA, causal; eager and sdpa), BERT (sdpa) and ViT (eager),
   with chunks of one query row, and the replay's decision is recorded (``replayed``);
2. the replay declines, with its reason, for ``discard_ratio``, Swin's windows, a timm model,
   ``output_attentions=True`` and a forward hook on an attention module (the weights are then
   the model's own), and the maps are the dense path's;
3. no (B, H, N, N) or (B, N, N) map is made in the forward pass, nor a causal (N, N) mask on sdpa;
4. an exception inside the forward leaves the model and transformers' registries as they were;
5. two threads explaining with one instance each replay their own calls;
6. below the dense maps' budget (``DENSE_MAPS_BUDGET_BYTES``, set to 0 for the tests above) the
   replay declines, saying so, and the maps are the dense path's.
"""
from __future__ import annotations

import threading

import pytest
import torch

import captum_transformers as ct
import captum_transformers.functional as functional
import captum_transformers.capture.replayed_rows as replayed_rows
import captum_transformers.capture.row_chunks as chunking
import captum_transformers.propagation.attention.core as core
from restore import assert_same, raising_after, snapshot

F64 = torch.float64


def _hf(name, impl, batch=2, seq=7):
    from hf_models import CASES
    case = CASES[name]
    inputs, kwargs = case.inputs(batch=batch, seq=seq, dtype=F64)
    return case.model(impl, dtype=F64), inputs, kwargs


MODELS = {
    "llama eager": lambda: _hf("llama_gqa", "eager"),
    "llama sdpa": lambda: _hf("llama_gqa", "sdpa"),
    "bert sdpa": lambda: _hf("bert", "sdpa"),
    "vit eager": lambda: _hf("vit", "eager"),
}
METHODS = {
    **{f"rollout {fusion} from {start}": (ct.AttentionRollout, dict(head_fusion=fusion, start_layer=start))
       for fusion in ("mean", "max", "min") for start in (0, 1)},
    **{f"raw {fusion}": (ct.RawAttention, dict(head_fusion=fusion)) for fusion in ("mean", "max", "min")},
}


@pytest.fixture(autouse=True)
def replay_at_any_size(monkeypatch):
    """These tiny models' dense maps fit the budget (the dense path is cheaper there): replay them anyway."""
    monkeypatch.setattr(replayed_rows, "DENSE_MAPS_BUDGET_BYTES", 0)


@pytest.fixture
def one_row_chunks(monkeypatch):
    """Chunks of one query row, and a count of the replayed calls' chunks."""
    monkeypatch.setattr(chunking, "ROW_CHUNK_BYTES", 1)
    chunks = []
    original = replayed_rows.call_chunks

    def counted(*args, **kwargs):
        for chunk in original(*args, **kwargs):
            chunks.append(chunk[1].shape)
            yield chunk

    monkeypatch.setattr(replayed_rows, "call_chunks", counted)
    return chunks


def _with_dense(method, inputs, kwargs):
    """``(attribute's scores, its replay, the forward values it reduced, the dense path's scores)``."""
    values, reduce = [], method.reduce
    method.reduce = lambda trace: (values.extend(r.forward_value for r in trace.records), reduce(trace))[1]
    scores = method.attribute(inputs, target=1, forward_kwargs=kwargs, return_tokens=True)
    replay = method._row_stream
    del method.reduce
    trace = method.trace(inputs, target=1, forward_kwargs=kwargs)
    assert method._row_stream is None  # trace() keeps the maps
    return scores, replay, values, trace.layout.returned(method.stream_scores(trace)["tokens"])


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("method_name", list(METHODS))
def test_replayed_rows_equal_the_dense_path(model_name, method_name, one_row_chunks):
    model, inputs, kwargs = MODELS[model_name]()
    cls, options = METHODS[method_name]
    scores, replay, values, dense = _with_dense(cls(model, **options), inputs, kwargs)
    assert replay.replayed, replay.reason
    assert values and all(v is None for v in values), "no map kept: every call replayed"
    assert one_row_chunks and all(shape[-2] == 1 for shape in one_row_chunks)
    assert scores.dtype == F64 and scores.abs().max() > 1e-3  # not a trivially equal zero map
    torch.testing.assert_close(scores, dense, rtol=0, atol=1e-12)


def test_chunks_without_explained_rows_are_not_replayed(one_row_chunks):
    """Raw attention replays only the last call's chunk of the explained row; rollout skips the
    rows its carried row has not reached yet (a causal model explained at its last real token)."""
    model, inputs, kwargs = _hf("llama_gqa", "sdpa")
    forward = model.config.num_hidden_layers * inputs.shape[1]  # the outputs: every row of every call
    assert model.config.num_hidden_layers == 2
    ct.RawAttention(model).attribute(inputs, target=1, forward_kwargs=kwargs, return_tokens=True)
    assert len(one_row_chunks) == forward + 2  # the explained rows: 6 (example 0) and 4 (example 1, padded after 5)
    one_row_chunks.clear()
    ct.AttentionRollout(model).attribute(inputs, target=1, forward_kwargs=kwargs, return_tokens=True)
    assert len(one_row_chunks) == forward + 2 + inputs.shape[1]  # the last call: those two rows; the first: all


def _timm_vit():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.models.vision_transformer.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2,
                                                             num_heads=2, num_classes=5)
    return model.to(F64).eval(), torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1), dtype=F64), {}


def _swin():
    from swin_models import hf_swin
    return hf_swin(dtype=F64), torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1), dtype=F64), {}


DECLINED = {
    "discard_ratio": (lambda: _hf("llama_gqa", "sdpa"), dict(discard_ratio=0.5), "discard_ratio"),
    "swin": (_swin, {}, "windowed"),
    "timm": (_timm_vit, {}, "HuggingFace kernel"),
}


@pytest.mark.parametrize("case", list(DECLINED))
@pytest.mark.parametrize("cls", [ct.AttentionRollout, ct.RawAttention])
def test_the_replay_declines_with_its_reason(case, cls):
    build, options, reason = DECLINED[case]
    if case == "discard_ratio" and cls is ct.RawAttention:
        pytest.skip("raw attention has no discard_ratio")
    model, inputs, kwargs = build()
    scores, replay, values, dense = _with_dense(cls(model, **options), inputs, kwargs)
    assert replay.replayed is False and reason in replay.reason, replay.reason
    assert values and all(v is not None for v in values), "declined: the maps are kept"
    torch.testing.assert_close(scores, dense, rtol=0, atol=1e-12)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("cls", [ct.AttentionRollout, ct.RawAttention])
def test_requested_attention_weights_decline_the_replay(cls, impl):
    """output_attentions=True: the model returns its real weights and the maps are the dense path's."""
    model, inputs, kwargs = _hf("llama_gqa", impl)
    kwargs = {**kwargs, "output_attentions": True}
    with torch.no_grad():  # the same weights' eager attention (sdpa returns none)
        expected = _hf("llama_gqa", "eager")[0](inputs, **kwargs).attentions
    assert len(expected) == model.config.num_hidden_layers
    seen = []
    handle = model.register_forward_hook(lambda module, args, output: seen.append(output.attentions))
    try:
        scores, replay, values, dense = _with_dense(cls(model), inputs, kwargs)
    finally:
        handle.remove()
    assert replay.replayed is False and "output_attentions" in replay.reason, replay.reason
    assert len(seen[0]) == len(expected)
    for returned, own in zip(seen[0], expected):
        assert returned.abs().max() > 0.1  # not a stand-in
        torch.testing.assert_close(returned, own, rtol=0, atol=1e-6)
    torch.testing.assert_close(scores, dense, rtol=0, atol=1e-12)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_a_hook_on_any_attention_module_declines_the_replay_before_the_first_call(impl):
    """A hook on the last layer's attention declines at the first call, before any map is dropped."""
    model, inputs, kwargs = _hf("llama_gqa", impl)
    seen = []
    attention = model.model.layers[-1].self_attn
    handle = attention.register_forward_hook(lambda module, args, output: seen.append(output[1]))
    try:
        scores, replay, values, dense = _with_dense(ct.AttentionRollout(model), inputs, kwargs)
    finally:
        handle.remove()
    assert replay.replayed is False and "forward hook" in replay.reason, replay.reason
    assert all(v is not None for v in values)
    with torch.no_grad():
        own = _hf("llama_gqa", "eager")[0](inputs, **kwargs, output_attentions=True).attentions[-1]
    torch.testing.assert_close(seen[0], own, rtol=0, atol=1e-6)
    torch.testing.assert_close(scores, dense, rtol=0, atol=1e-12)


def test_weights_read_without_announcement_fail_loudly():
    """A module that reads its weights with nothing to announce it gets a stand-in that raises."""
    model, inputs, kwargs = _hf("llama_gqa", "eager")
    attention = model.model.layers[0].self_attn
    own_forward = attention.forward

    def reading(*args, **kw):
        output, weights = own_forward(*args, **kw)
        return output + 0 * weights.sum(), weights

    attention.forward = reading
    with pytest.raises(ct.CaptureError, match="output_attentions=True"):
        ct.AttentionRollout(model).attribute(inputs, target=1, forward_kwargs=kwargs, return_tokens=True)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_no_map_is_made_in_the_forward_pass(impl, monkeypatch):
    """Softmax inputs and fused maps have one query row per chunk; on sdpa no (N, N) causal mask is
    built or kept (eager: the model's own additive mask, made once and shared by the layers)."""
    model, inputs, kwargs = _hf("llama_gqa", impl, batch=1)
    monkeypatch.setattr(chunking, "ROW_CHUNK_BYTES", 1)
    tokens, softmaxed, fused, ones = inputs.shape[1], [], [], []
    softmax, fuse, ones_like = torch.softmax, functional.fuse_heads, torch.ones

    def watched_softmax(tensor, *args, **kw):
        softmaxed.append(tuple(tensor.shape))
        return softmax(tensor, *args, **kw)

    def watched_fuse(probs, *args, **kw):
        fused.append(tuple(probs.shape))
        return fuse(probs, *args, **kw)

    def watched_ones(*args, **kw):
        ones.append(args)
        return ones_like(*args, **kw)

    monkeypatch.setattr(torch, "softmax", watched_softmax)
    monkeypatch.setattr(functional, "fuse_heads", watched_fuse)
    monkeypatch.setattr(torch, "ones", watched_ones)
    kept, keep = [], replayed_rows.ReplayedRows.keep
    monkeypatch.setattr(replayed_rows.ReplayedRows, "keep",
                        lambda self, index, call: (kept.append(call), keep(self, index, call))[1])
    for cls in (ct.AttentionRollout, ct.RawAttention):
        method = cls(model)
        method.attribute(inputs, target=1, return_tokens=True)
        assert method._row_stream.replayed, method._row_stream.reason
    assert softmaxed and all(s[-2] == 1 for s in softmaxed if len(s) == 4), softmaxed
    assert fused and all(s[-2] == 1 for s in fused), fused
    assert (tokens, tokens) not in ones, "an (N, N) causal mask was built"
    if impl == "sdpa":  # SDPA's masks: none for one causal sequence (the chunks make theirs)
        assert kept and all(call.causal and not call.extras for call in kept)
    else:  # the eager mask transformers builds once per forward pass (two here), shared by the layers
        assert kept and len({e.untyped_storage().data_ptr() for call in kept for e in call.extras}) <= 2
    fused.clear()
    ct.AttentionRollout(model).trace(inputs, target=1)  # the check can fail: the dense path fuses whole maps
    assert any(s[-2:] == (tokens, tokens) for s in fused)


def test_an_exception_inside_the_forward_restores_the_model_and_the_registries():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    model, inputs, kwargs = _hf("llama_gqa", "sdpa")
    before = snapshot(model)
    registries = (dict(ALL_ATTENTION_FUNCTIONS._global_mapping), dict(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping))
    method = ct.AttentionRollout(model)
    with raising_after(model.model.layers[1].mlp, RuntimeError("midway")), pytest.raises(RuntimeError, match="midway"):
        method.attribute(inputs, target=1, forward_kwargs=kwargs, return_tokens=True)
    assert_same(before, snapshot(model))
    assert (dict(ALL_ATTENTION_FUNCTIONS._global_mapping), dict(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping)) \
        == registries
    scores, replay, _, dense = _with_dense(method, inputs, kwargs)  # the next call replays afresh
    assert replay.replayed
    torch.testing.assert_close(scores, dense, rtol=0, atol=1e-12)


def test_two_threads_replay_their_own_calls():
    """Both threads finish their forward passes before either reduces: each reads its own replay."""
    model, inputs, kwargs = _hf("llama_gqa", "sdpa", batch=1)
    other = torch.flip(inputs, dims=[1])
    method = ct.AttentionRollout(model)
    barrier, reduce = threading.Barrier(2, timeout=60), method.reduce
    method.reduce = lambda trace: (barrier.wait(), reduce(trace))[1]
    results, replays, errors = {}, {}, []

    def explain(name, ids):
        try:
            results[name] = method.attribute(ids, target=1, return_tokens=True)
            replays[name] = method._row_stream
        except BaseException as error:  # reported below
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=explain, args=(n, t)) for n, t in (("a", inputs), ("b", other))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    del method.reduce
    assert replays["a"] is not replays["b"] and replays["a"].replayed and replays["b"].replayed
    for name, ids in (("a", inputs), ("b", other)):
        trace = method.trace(ids, target=1)
        dense = trace.layout.returned(method.stream_scores(trace)["tokens"])
        torch.testing.assert_close(results[name], dense, rtol=0, atol=1e-12)
    assert not torch.allclose(results["a"], results["b"])


@pytest.mark.parametrize("cls", [ct.AttentionRollout, ct.RawAttention])
def test_several_streams_decline_before_the_forward_pass(cls):
    """BART (encoder, decoder, cross-attention; sdpa): declined from the blocks, the maps kept."""
    import transformers
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
        init_std=0.1, attn_implementation="sdpa")).to(F64).eval()
    generator = torch.Generator().manual_seed(1)
    inputs = (torch.randint(3, 90, (2, 7), generator=generator), torch.randint(3, 90, (2, 4), generator=generator))
    method = cls(model)
    scores = method.attribute(inputs, target=1, return_tokens=True)
    replay = method._row_stream
    assert replay.replayed is False and "several token streams" in replay.reason, replay.reason
    trace = method.trace(inputs, target=1)
    dense = method.stream_scores(trace)
    for returned, (name, layout) in zip(scores, trace.streams.layouts.items()):
        torch.testing.assert_close(returned, layout.returned(dense[name]), rtol=0, atol=1e-12)


def test_the_replay_declines_where_the_dense_maps_fit_the_budget(monkeypatch):
    """Replaying costs chunked products (1.14-1.19x a forward on a 6-layer ViT at 145 tokens against
    1.01-1.06x for the dense maps): below the budget the maps are kept."""
    model, inputs, kwargs = MODELS["llama sdpa"]()
    for budget, replayed in ((10 ** 9, False), (0, True)):
        monkeypatch.setattr(replayed_rows, "DENSE_MAPS_BUDGET_BYTES", budget)
        method = ct.AttentionRollout(model)
        scores, replay, values, dense = _with_dense(method, inputs, kwargs)
        assert replay.replayed is replayed, replay.reason
        if not replayed:
            assert "fit the budget" in replay.reason and all(v is not None for v in values)
        torch.testing.assert_close(scores, dense, rtol=0, atol=1e-12)
    batch, heads, tokens = 2, 4, 7
    assert replayed_rows.dense_maps_bytes(2, batch, heads, tokens, tokens, 8) == 2 * 2 * 49 * 8 + 2 * 4 * 49 * 8
    assert replayed_rows.dense_maps_bytes(2, batch, heads, tokens, tokens, 2) == 2 * 2 * 49 * 4 + 2 * 4 * 49 * 2
