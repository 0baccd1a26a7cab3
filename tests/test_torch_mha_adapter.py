"""torch.nn.MultiheadAttention adapter x every attention method.

Tiny user models around nn.TransformerEncoder are checked against an explicit
reimplementation (probabilities and gradients), for batch invariance (with padding),
for the fast path being restored, and for exact restore after normal exit and exceptions.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from captum_transformers import (ATTENTION_METHODS, AttentionGradCAM, CaptureSpec, GenericAttention, InputError,
                                 RawAttention, get_adapter)
from captum_transformers.capture.recorder import Recorder
from captum_transformers.adapters.torch_mha import TorchMHAAdapter
from captum_transformers.functional import gradient_weighted_heads
from captum_transformers.engine.runner import run_trace
from restore import assert_same, raising_after, snapshot

METHODS = [pytest.param(m, id=m.__name__) for m in ATTENTION_METHODS]
VOCAB, DIM, HEADS, CLASSES, MAX_LEN = 23, 16, 2, 5, 8
KEEP = CaptureSpec(forward_reduce=lambda probs: probs.clone())
RAW_GRAD = CaptureSpec(backward_reduce=lambda probs, grad, valid: grad.clone())


class Classifier(nn.Module):
    """Embedding + 2-layer nn.TransformerEncoder + linear head on token 0."""

    def __init__(self, batch_first: bool = True, embeddings_input: bool = False):
        super().__init__()
        self.batch_first = batch_first
        self.embeddings_input = embeddings_input
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(1, MAX_LEN, DIM) * 0.5)
        layer = nn.TransformerEncoderLayer(DIM, HEADS, dim_feedforward=32, dropout=0.0, batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=batch_first)
        self.head = nn.Linear(DIM, CLASSES)

    def embeddings(self, ids):
        return self.embed(ids) + self.pos[:, : ids.shape[1]]

    def forward(self, inputs, key_padding_mask=None):
        x = inputs + self.pos[:, : inputs.shape[1]] if self.embeddings_input else self.embeddings(inputs)
        if not self.batch_first:
            x = x.transpose(0, 1)
        h = self.encoder(x, src_key_padding_mask=key_padding_mask)
        return self.head(h[:, 0] if self.batch_first else h[0])


class CausalLM(Classifier):
    """Next-token logits (B, S, V) from a causally masked encoder."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids, key_padding_mask=None):
        # Boolean like the padding mask (PyTorch warns about mixed mask types).
        mask = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).triu(1)
        h = self.encoder(self.embeddings(ids), mask=mask, is_causal=True, src_key_padding_mask=key_padding_mask)
        return self.head(h)


class DirectMHA(nn.Module):
    """nn.MultiheadAttention used directly, asking for no weights (as most user code does)."""

    def __init__(self, is_causal: bool = False, **mha_kwargs):
        super().__init__()
        self.is_causal = is_causal
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True, **mha_kwargs)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, ids):
        x = self.embed(ids)
        out, _ = self.attn(x, x, x, need_weights=False, is_causal=self.is_causal)
        return self.head(out[:, -1] if self.is_causal else out[:, 0])


def _model(cls=Classifier, **kwargs):
    return cls(**kwargs).eval()


def _ids(batch=3, length=6):
    return torch.randint(0, VOCAB, (batch, length))


def _padding(lengths, length=6):
    """Right padding, True = pad (nn.MultiheadAttention convention)."""
    return torch.arange(length)[None, :] >= torch.tensor(lengths)[:, None]


def reference(model: Classifier, ids, key_padding_mask=None, causal=False):
    """Explicit reimplementation: (output, per-layer probabilities (B, H, S, S))."""
    x = model.embeddings(ids)
    batch, length, _ = x.shape
    head_dim = DIM // HEADS
    blocked = torch.zeros(batch, 1, length, length, dtype=torch.bool)
    if key_padding_mask is not None:
        blocked = blocked | key_padding_mask[:, None, None, :]
    if causal:
        blocked = blocked | torch.ones(length, length, dtype=torch.bool).triu(1)
    probs = []
    for layer in model.encoder.layers:
        mha = layer.self_attn
        q, k, v = F.linear(x, mha.in_proj_weight, mha.in_proj_bias).chunk(3, dim=-1)
        q, k, v = (t.reshape(batch, length, HEADS, head_dim).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(head_dim)
        attention = scores.masked_fill(blocked, float("-inf")).softmax(dim=-1)
        probs.append(attention)
        mixed = mha.out_proj((attention @ v).transpose(1, 2).reshape(batch, length, DIM))
        x = layer.norm1(x + mixed)
        x = layer.norm2(x + layer.linear2(F.relu(layer.linear1(x))))
    return model.head(x if causal else x[:, 0]), probs


def _reference_generic(model, ids, targets, key_padding_mask=None, causal=False, rows=None):
    """GenericAttention (Chefer et al. ICCV'21) from the explicit model, via autograd.grad."""
    output, probs = reference(model, ids, key_padding_mask, causal)
    batch = ids.shape[0]
    if causal:
        output = output[torch.arange(batch), rows]
    grads = torch.autograd.grad(output[torch.arange(batch), targets].sum(), probs)
    relevance = torch.eye(ids.shape[1]).expand(batch, -1, -1)
    for attention, grad in zip(probs, grads):
        relevance = relevance + (grad * attention).clamp(min=0).mean(dim=1) @ relevance
    rows = torch.zeros(batch, dtype=torch.long) if rows is None else rows
    return relevance[torch.arange(batch), rows], probs, grads


def _targets(batch):
    return [(2 * i + 1) % CLASSES for i in range(batch)]


# -- registry -----------------------------------------------------------------------------
def test_user_models_find_the_adapter_through_their_submodules():
    for model in (_model(), _model(batch_first=False), _model(CausalLM), DirectMHA(),
                  nn.TransformerEncoder(nn.TransformerEncoderLayer(DIM, HEADS), 1, enable_nested_tensor=False)):
        adapter = get_adapter(model)
        assert isinstance(adapter, TorchMHAAdapter) and adapter.name == "torch_mha"
    assert isinstance(get_adapter(_model(), "torch_mha"), TorchMHAAdapter)


def test_blocks_and_decoder_cross_attention_kind():
    assert [b.name for b in TorchMHAAdapter().blocks(_model())] == [
        "encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]
    decoder = nn.TransformerDecoderLayer(DIM, HEADS)
    assert [(b.name, b.kind) for b in TorchMHAAdapter().blocks(decoder)] == [
        ("self_attn", "self"), ("multihead_attn", "cross")]


# -- every method: shapes and batch invariance ----------------------------------------------
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("variant", ["batch_first", "seq_first", "embeddings"])
def test_output_shape_follows_input(method, variant):
    model = _model(batch_first=variant != "seq_first", embeddings_input=variant == "embeddings")
    inputs = torch.randn(2, 6, DIM) if variant == "embeddings" else _ids(2)
    attributions = method(model).attribute(inputs, target=1)
    assert attributions.shape == inputs.shape and torch.isfinite(attributions).all()
    tokens = method(model).attribute(inputs, target=1, return_tokens=True)
    assert tokens.shape == (2, 6)
    if method is not AttentionGradCAM:  # Grad-CAM's ReLU may zero a random model's map
        assert tokens.abs().sum() > 0


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("batch_first", [True, False])
def test_batch_equals_single(method, batch_first):
    model = _model(batch_first=batch_first)
    ids, targets = _ids(3), _targets(3)
    explainer = method(model)
    batched = explainer.attribute(ids, target=targets, return_tokens=True)
    for i in range(3):
        single = explainer.attribute(ids[i:i + 1], target=targets[i], return_tokens=True)
        torch.testing.assert_close(batched[i:i + 1], single, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("model_cls", [Classifier, CausalLM], ids=["encoder", "causal"])
def test_batch_equals_single_with_padding(method, model_cls):
    model = _model(model_cls)
    lengths = [6, 4, 3]
    ids, mask, targets = _ids(3), _padding(lengths), _targets(3)
    explainer = method(model)
    batched = explainer.attribute(ids, target=targets, additional_forward_args=(mask,), return_tokens=True)
    assert (batched[mask] == 0).all(), "padding tokens get no attribution"
    for i, length in enumerate(lengths):
        single = explainer.attribute(ids[i:i + 1], target=targets[i], additional_forward_args=(mask[i:i + 1],),
                                     return_tokens=True)
        torch.testing.assert_close(batched[i:i + 1], single, atol=1e-5, rtol=1e-4)
        # Padding is invisible: the same as the unpadded sequence alone.
        alone = explainer.attribute(ids[i:i + 1, :length], target=targets[i], return_tokens=True)
        torch.testing.assert_close(batched[i:i + 1, :length], alone, atol=1e-5, rtol=1e-4)


# -- against an explicit reimplementation -------------------------------------------------
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("padded", [False, True])
def test_probabilities_match_explicit_recomputation(batch_first, padded):
    model = _model(batch_first=batch_first)
    ids = _ids(3)
    mask = _padding([6, 4, 2]) if padded else None
    trace = run_trace(TorchMHAAdapter(), model, (ids,), (mask,), 0, KEEP)
    output, expected = reference(model, ids, mask)
    assert len(trace) == 2
    for record, probs in zip(trace.records, expected):
        assert record.forward_value.shape == (3, HEADS, 6, 6)
        torch.testing.assert_close(record.forward_value, probs, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(trace.logits, output, atol=1e-5, rtol=1e-5)
    if padded:
        assert torch.equal(trace.layout.token_mask, ~mask)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_generic_attention_gradient_matches_autograd(batch_first, frozen, padded):
    model = _model(batch_first=batch_first)
    ids, targets = _ids(3), _targets(3)
    mask = _padding([6, 5, 3]) if padded else None
    expected, probs, grads = _reference_generic(model, ids, targets, mask)
    if padded:
        expected = expected * (~mask)
    if frozen:
        model.requires_grad_(False)
    trace = run_trace(TorchMHAAdapter(), model, (ids,), (mask,), targets, RAW_GRAD)
    for record, grad in zip(trace.records, grads):
        torch.testing.assert_close(record.backward_value, grad, atol=1e-6, rtol=1e-4)
    fused = run_trace(TorchMHAAdapter(), model, (ids,), (mask,), targets,
                                    CaptureSpec(backward_reduce=gradient_weighted_heads))
    for record, attention, grad in zip(fused.records, probs, grads):
        torch.testing.assert_close(record.backward_value, (grad * attention).clamp(min=0).mean(dim=1),
                                   atol=1e-6, rtol=1e-4)
    scores = GenericAttention(model).attribute(ids, target=targets, additional_forward_args=(mask,),
                                               return_tokens=True)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-4)
    assert all(p.grad is None for p in model.parameters())


def test_causal_model_uses_last_real_token_and_matches_reference():
    model = _model(CausalLM)
    ids, mask, targets = _ids(3), _padding([6, 4, 5]), _targets(3)
    trace = run_trace(TorchMHAAdapter(), model, (ids,), (mask,), targets, KEEP)
    assert trace.layout.query_rows.squeeze(1).tolist() == [5, 3, 4]
    _, expected = reference(model, ids, mask, causal=True)
    for record, probs in zip(trace.records, expected):
        torch.testing.assert_close(record.forward_value, probs, atol=1e-6, rtol=1e-5)
        assert (record.forward_value.triu(1) == 0).all()
    rows = torch.tensor([5, 3, 4])
    reference_scores, _, _ = _reference_generic(model, ids, targets, mask, causal=True, rows=rows)
    scores = GenericAttention(model).attribute(ids, target=targets, additional_forward_args=(mask,),
                                               return_tokens=True)
    torch.testing.assert_close(scores, reference_scores * (~mask), atol=1e-5, rtol=1e-4)


def test_is_causal_without_a_mask_gets_an_explicit_causal_mask():
    model = DirectMHA(is_causal=True).eval()
    ids = _ids(2, 5)
    trace = run_trace(TorchMHAAdapter(), model, (ids,), (), 0, KEEP)
    probs = trace.records[0].forward_value
    assert (probs.triu(1) == 0).all() and torch.allclose(probs.sum(-1), torch.ones(2, HEADS, 5))
    assert trace.layout.query_rows.squeeze(1).tolist() == [4, 4]
    scores = RawAttention(model).attribute(ids, return_tokens=True)
    torch.testing.assert_close(scores, probs.mean(1)[:, -1])


class LayerWithMask(nn.Module):
    """A TransformerEncoderLayer given a causal float mask but no is_causal hint."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layer = nn.TransformerEncoderLayer(DIM, HEADS, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, ids, mask):
        return self.head(self.layer(self.embed(ids), src_mask=mask)[:, -1])


def test_causal_mask_without_hint_is_detected():
    model = LayerWithMask().eval()
    ids = _ids(2, 5)
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    trace = run_trace(TorchMHAAdapter(), model, (ids,), (causal,), 0, KEEP)
    assert trace.layout.query_rows.squeeze(1).tolist() == [4, 4]
    band = torch.zeros(5, 5).masked_fill(torch.ones(5, 5, dtype=torch.bool).tril(-2), float("-inf"))
    trace = run_trace(TorchMHAAdapter(), model, (ids,), (band,), 0, KEEP)
    assert trace.layout.query_rows.squeeze(1).tolist() == [0, 0], "not causal: the first token"


# -- the wrapped forward keeps MultiheadAttention's contract --------------------------------
@pytest.mark.parametrize("batch_first", [True, False])
def test_wrapped_forward_returns_what_the_caller_asked_for(batch_first):
    mha = nn.MultiheadAttention(DIM, HEADS, batch_first=batch_first).eval()
    x = torch.randn(2, 5, DIM) if batch_first else torch.randn(5, 2, DIM)
    padding = _padding([5, 3], 5)
    with torch.no_grad():
        plain_out, plain_mean = mha(x, x, x, key_padding_mask=padding)
        _, plain_heads = mha(x, x, x, key_padding_mask=padding, average_attn_weights=False)
    recorder = Recorder(KEEP)
    with torch.no_grad(), TorchMHAAdapter().capture(mha, recorder):
        out, mean = mha(x, x, x, key_padding_mask=padding)
        out_none, none = mha(x, x, x, key_padding_mask=padding, need_weights=False)
        _, heads = mha(x, x, x, key_padding_mask=padding, average_attn_weights=False)
        single = x[0] if batch_first else x[:, 0]
        unbatched_out, unbatched = mha(single, single, single, average_attn_weights=False)
    torch.testing.assert_close(out, plain_out)
    torch.testing.assert_close(out_none, plain_out, atol=1e-6, rtol=1e-5)
    assert none is None
    torch.testing.assert_close(mean, plain_mean)
    torch.testing.assert_close(heads, plain_heads)
    assert unbatched.shape == (HEADS, 5, 5) and unbatched_out.dim() == 2
    assert [tuple(s.forward_value.shape) for s in recorder.sites] == [(2, HEADS, 5, 5)] * 3 + [(1, HEADS, 5, 5)]
    assert torch.equal(recorder.key_valid, ~padding)


@pytest.mark.parametrize("mha_kwargs", [{"add_zero_attn": True}, {"add_bias_kv": True}], ids=["zero_attn", "bias_kv"])
def test_extra_keys_are_dropped_from_the_map(mha_kwargs):
    model = DirectMHA(**mha_kwargs).eval()
    ids = _ids(2, 5)
    trace = run_trace(TorchMHAAdapter(), model, (ids,), (), 0, RAW_GRAD)
    assert trace.records[0].backward_value.shape == (2, HEADS, 5, 5)
    for method in ATTENTION_METHODS:
        assert method(model).attribute(ids, target=0).shape == ids.shape


# -- query rows ---------------------------------------------------------------------------
def test_query_rows_option():
    model = _model()
    ids, mask = _ids(3), _padding([6, 4, 3])
    def layout(option):
        return run_trace(TorchMHAAdapter(option), model, (ids,), (mask,), 0, KEEP).layout

    def rows(option):
        return layout(option).query_rows
    assert rows(None).squeeze(1).tolist() == [0, 0, 0]
    assert rows("last").squeeze(1).tolist() == [5, 3, 2]
    assert rows(2).squeeze(1).tolist() == [2, 2, 2]
    assert rows(-1).squeeze(1).tolist() == [5, 5, 5]
    mean = layout("mean")
    assert mean.query_rows.tolist() == [list(range(6))] * 3
    for weights, length in zip(mean.query_weights, [6, 4, 3]):
        torch.testing.assert_close(weights, torch.tensor([1 / length] * length + [0.0] * (6 - length)))
    with pytest.raises(InputError):
        TorchMHAAdapter("first")
    with pytest.raises(InputError):
        rows(6)


@pytest.mark.parametrize("method", METHODS)
def test_mean_rows_batch_equals_single_with_padding(method):
    model = _model()
    lengths = [6, 4, 3]
    ids, mask, targets = _ids(3), _padding(lengths), _targets(3)
    explainer = method(model, adapter=TorchMHAAdapter("mean"))
    batched = explainer.attribute(ids, target=targets, additional_forward_args=(mask,), return_tokens=True)
    for i in range(3):
        single = explainer.attribute(ids[i:i + 1], target=targets[i], additional_forward_args=(mask[i:i + 1],),
                                     return_tokens=True)
        torch.testing.assert_close(batched[i:i + 1], single, atol=1e-5, rtol=1e-4)


# -- fast path and restore ----------------------------------------------------------------
def _padded_outputs_zeroed(model, ids, mask) -> bool:
    """The nested-tensor fast path returns exact zeros at padded positions; the slow path does not."""
    with torch.no_grad():
        hidden = model.encoder(model.embeddings(ids), src_key_padding_mask=mask)
    return bool((hidden[mask] == 0).all())


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("method", METHODS)
def test_works_in_eval_under_no_grad_and_restores_fast_path(method):
    model = _model()
    ids, mask = _ids(3), _padding([6, 4, 3])
    assert torch.backends.mha.get_fastpath_enabled()
    assert _padded_outputs_zeroed(model, ids, mask), "precondition: the fast path is taken"
    with torch.no_grad():
        scores = method(model).attribute(ids, target=1, additional_forward_args=(mask,), return_tokens=True)
    assert scores.shape == (3, 6) and torch.isfinite(scores).all()
    assert torch.backends.mha.get_fastpath_enabled()
    assert _padded_outputs_zeroed(model, ids, mask), "the fast path is used again after the capture"


def test_fast_path_left_disabled_if_the_caller_disabled_it():
    model = _model()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        GenericAttention(model).attribute(_ids(2), target=0)
        assert not torch.backends.mha.get_fastpath_enabled()
    finally:
        torch.backends.mha.set_fastpath_enabled(True)


@pytest.mark.parametrize("method", METHODS)
def test_exact_restore_after_normal_exit(method):
    model = _model()
    ids, mask = _ids(3), _padding([6, 4, 3])
    with torch.no_grad():
        before_output = model(ids, mask)
    before = snapshot(model)
    method(model).attribute(ids, target=1, additional_forward_args=(mask,))
    assert_same(before, snapshot(model))
    assert not any("forward" in vars(m) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(ids, mask), before_output)


@pytest.mark.parametrize("method", METHODS)
def test_exact_restore_after_exception_mid_forward(method):
    model = _model()
    ids, mask = _ids(3), _padding([6, 4, 3])
    with torch.no_grad():
        before_output = model(ids, mask)
    before = snapshot(model)

    with raising_after(model.encoder.layers[1], RuntimeError("boom in layer 1")):
        with pytest.raises(RuntimeError, match="boom in layer 1"):
            method(model).attribute(ids, target=1, additional_forward_args=(mask,))
    assert_same(before, snapshot(model))
    assert not any("forward" in vars(m) for m in model.modules())
    assert torch.backends.mha.get_fastpath_enabled()
    with torch.no_grad():
        assert torch.equal(model(ids, mask), before_output)


@pytest.mark.parametrize("method", METHODS)
def test_frozen_parameters(method):
    model = _model().requires_grad_(False)
    scores = method(model).attribute(_ids(2), target=[0, 3], return_tokens=True)
    assert scores.shape == (2, 6) and torch.isfinite(scores).all()
    assert all(p.grad is None and not p.requires_grad for p in model.parameters())
