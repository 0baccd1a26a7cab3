"""Swin and Swin v2 (HuggingFace): windowed attention as token-to-token maps (docs/windowed-attention.md).

What is proved here, on tiny models built from configs:

1. the geometry of each call is the model's own: HF's pad, cyclic shift and window partition
   applied to token numbers give :meth:`WindowGeometry.token_index`;
2. the definitions: a degenerate Swin (one stage whose window covers the grid: no shift, no
   merging) gives exactly the ViT path's math (``functional``) on the same maps, and a real
   Swin (shifted windows, padding, patch merging) equals a dense slow reference built from the
   doc's equations with full ``N x N`` matrices;
3. batch == single, any input size, exact restore, refusals;
4. LRP through the same rule engine: forward bit-identical under every rule set, AH+LN
   conservation to 1e-12 on a bias-free ReLU Swin in float64.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from captum_transformers import (AttentionGradCAM, AttentionRollout, AttnLRP, ConservativeLRP,  # noqa: E402
                                 GenericAttention, InputError, PartialLRP, RawAttention, RuleSet,
                                 TransformerLRP, TransformerRelevance, UnsupportedModelError, get_adapter)
from captum_transformers.capture.trace import AttentionTrace, TokenLayout  # noqa: E402
from captum_transformers.methods.lrp import RuleGradientXInput  # noqa: E402
from restore import assert_same, raising_after, snapshot  # noqa: E402
from swin_models import F64, dense_rows, hf_swin  # noqa: E402

ATTENTION = [RawAttention, AttentionRollout, AttentionGradCAM, GenericAttention, TransformerRelevance, PartialLRP]
GRADIENT_METHODS = {AttentionGradCAM, GenericAttention, TransformerRelevance, PartialLRP}


def _images(batch=3, size=(32, 32), dtype=torch.float32, seed=1):
    return torch.randn(batch, 3, *size, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _trace(method, model, x, target):
    explainer = method(model)
    return explainer, explainer.trace(x, target=target)


def _values(method, trace):
    return [r.backward_value if method in GRADIENT_METHODS else r.forward_value for r in trace.records]


# == 1. geometry ===================================================================================
@pytest.mark.parametrize("grid,window,shift", [((8, 8), 4, 2), ((6, 10), 4, 2), ((5, 7), 3, 1), ((4, 4), 4, 0)])
def test_geometry_is_the_models_own_partition(grid, window, shift):
    from transformers.models.swin.modeling_swin import window_partition

    from captum_transformers.capture.windows import WindowGeometry

    height, width = grid
    numbers = torch.arange(height * width, dtype=F64).reshape(1, height, width, 1)
    pad_h, pad_w = (-height) % window, (-width) % window
    padded = torch.nn.functional.pad(numbers + 1, (0, 0, 0, pad_w, 0, pad_h)) - 1  # padding -> -1
    shifted = torch.roll(padded, shifts=(-shift, -shift), dims=(1, 2))
    expected = window_partition(shifted, window).reshape(-1).long()
    geometry = WindowGeometry(grid, (window, window), (shift, shift), pad_first=True)
    assert torch.equal(geometry.token_index(), expected)


# == 2. the definitions =============================================================================
def _as_vit_trace(trace):
    """The same records under a plain (ViT) layout: one token sequence on the grid, explained at
    the mean of its tokens (query_rows = every token, weights 1/N), as a mean-pooled ViT is."""
    layout = trace.layout
    plain = TokenLayout(layout.num_tokens, layout.query_rows, None, 0, layout.grid, layout.query_weights)
    return AttentionTrace(trace.records, plain, trace.logits, trace.target)


VERSIONS = pytest.mark.parametrize("version", [1, 2], ids=["swin", "swinv2"])


@VERSIONS
@pytest.mark.parametrize("method", ATTENTION, ids=lambda m: m.__name__)
def test_degenerate_swin_is_the_vit_path(method, version):
    # One stage, window 4 on a 4x4 grid: one window of every token, no shift (HF clamps it), no merging.
    model = hf_swin(image=16, depths=(3,), heads=(2,), window=4, dtype=F64, version=version)
    x = _images(size=(16, 16), dtype=F64)
    explainer, trace = _trace(method, model, x, [0, 1, 2])
    assert all(g.num_windows == 1 and g.shift == (0, 0) for g in trace.layout.windows)
    # The package's own ViT path (each method's reduce) on the same maps, read at the mean row.
    expected = explainer.stream_scores(_as_vit_trace(trace))["tokens"]
    tokens = explainer.stream_scores(trace)["tokens"]
    torch.testing.assert_close(tokens, expected, rtol=1e-12, atol=1e-14)
    assert tokens.abs().sum() > 0


@VERSIONS
@pytest.mark.parametrize("method", ATTENTION, ids=lambda m: m.__name__)
@pytest.mark.parametrize("size", [(32, 32), (36, 44)], ids=["multiple", "padded"])
def test_windowed_rows_equal_the_dense_reference(method, size, version):
    # Two stages (a patch merging), shifted windows, and for 36x44 a 9x11 grid padded to windows of 4.
    model = hf_swin(depths=(2, 2), heads=(2, 2), window=4, dtype=F64, version=version)
    x = _images(size=size, dtype=F64)
    explainer, trace = _trace(method, model, x, [0, 1, 2])
    geometries = trace.layout.windows
    assert any(g.shift != (0, 0) for g in geometries) and geometries[0].grid != geometries[-1].grid
    values = _values(method, trace)
    if method in (RawAttention, AttentionGradCAM, PartialLRP):
        last = max(i for i, v in enumerate(values) if v is not None)
        values = [v if i == last else None for i, v in enumerate(values)]

    def layer_matrix(dense):
        eye = torch.eye(dense.shape[-1], dtype=F64)
        if method is AttentionRollout:
            return (eye + dense) / (eye + dense).sum(-1, keepdim=True)
        if method in (GenericAttention, TransformerRelevance):
            return eye + dense
        return dense

    expected = dense_rows(trace, values, layer_matrix)
    tokens = explainer.attribute(x, target=[0, 1, 2], return_tokens=True)
    torch.testing.assert_close(tokens, expected, rtol=1e-12, atol=1e-14)
    if method is AttentionRollout:  # rows of the rollout still sum to one
        torch.testing.assert_close(tokens.sum(-1), torch.ones(3, dtype=F64), rtol=1e-12, atol=1e-12)


# == 3. contract ===================================================================================
@VERSIONS
@pytest.mark.parametrize("method", ATTENTION, ids=lambda m: m.__name__)
def test_batch_single_input_size_and_restore(method, version):
    model = hf_swin(version=version)
    assert get_adapter(model).name == ("swin" if version == 1 else "swinv2")
    x = _images(size=(36, 44))
    explainer = method(model)
    maps = explainer.attribute(x, target=[0, 1, 2])
    assert maps.shape == x.shape and torch.isfinite(maps).all()
    tokens = explainer.attribute(x, target=[0, 1, 2], return_tokens=True)
    assert tokens.shape == (3, 9 * 11)
    for i in range(3):
        single = explainer.attribute(x[i:i + 1], target=i, return_tokens=True)
        torch.testing.assert_close(tokens[i:i + 1], single, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        before_output = model(x).logits
    before = snapshot(model)
    with raising_after(get_adapter(model).blocks(model)[-1].module, KeyboardInterrupt()):
        with pytest.raises(KeyboardInterrupt):
            explainer.attribute(x, target=[0, 1, 2])
    assert_same(before, snapshot(model))
    with torch.no_grad():
        assert torch.equal(model(x).logits, before_output)


def test_class_specific_methods_depend_on_the_target():
    # Larger weights than the default init (0.02): with those, TransformerRelevance's additions to
    # the identity are ~1e-8 of it on a random tiny model (measured), too close to compare.
    model = hf_swin(initializer_range=0.3)
    x = _images()
    for method in (GenericAttention, TransformerRelevance, AttentionGradCAM):
        a = method(model).attribute(x, target=[0, 0, 0], return_tokens=True)
        b = method(model).attribute(x, target=[1, 1, 1], return_tokens=True)
        assert (a - b).abs().max() > 1e-2 * (a - a.mean(-1, keepdim=True)).abs().max(), method.__name__


def test_refusals():
    model = hf_swin()
    x = _images()
    with pytest.raises(InputError, match="discard_ratio"):
        AttentionRollout(model, discard_ratio=0.5).attribute(x)
    with pytest.raises(UnsupportedModelError, match="'swin' adapter"):
        GenericAttention(model, adapter="huggingface")
    with pytest.raises(InputError, match="start_layer"):
        GenericAttention(model, start_layer=4).attribute(x, target=0)


# == 4. LRP through the rule engine =================================================================
RULE_SETS = [RuleSet.GRADIENT, RuleSet.AH, RuleSet.AH_LN, RuleSet.CHEFER, RuleSet.LRP, RuleSet.ATTN_LRP]


@VERSIONS
@pytest.mark.parametrize("rules", RULE_SETS, ids=lambda r: r.name)
def test_forward_bit_identical_under_rules(rules, version):
    model = hf_swin(version=version)
    x = _images(size=(36, 44))
    with torch.enable_grad():
        plain = model(x).logits
        with get_adapter(model).propagation(model, rules):
            inside = model(x).logits
    assert torch.equal(plain, inside)


def _bias_free_relu_swin(version=1):
    model = hf_swin(depths=(2, 2), heads=(2, 2), window=4, dtype=F64, hidden_act="relu", qkv_bias=False,
                    version=version)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.zero_()
    return model


def test_ah_ln_conserves_on_a_bias_free_swin():
    model = _bias_free_relu_swin()
    x = _images(batch=4, size=(36, 44), dtype=F64)
    logits = model(x).logits[:, 1].detach()
    relevance, delta = ConservativeLRP(model).attribute(x, target=1, return_tokens=True,
                                                        return_convergence_delta=True)
    assert relevance.shape == (4, 9 * 11)
    errors = (relevance.sum(-1) - logits).abs() / logits.abs()
    assert errors.max() <= 1e-12, errors
    assert (delta.abs() / logits.abs()).max() <= 1e-12
    # Rules that pass relevance through the softmax into the scores (AttnLRP; here with the identity
    # softmax, which conserves on a bias-free ViT) lose the share of the relative position bias, an
    # additive constant in Swin's scores: measured |delta| 1e-3 with the table, 2e-17 without it.
    identity_softmax = dataclasses.replace(RuleSet.ATTN_LRP, name="AttnLRP+identity softmax", softmax="identity")
    _, delta = RuleGradientXInput(model, identity_softmax).attribute(x, target=1, return_tokens=True,
                                                                     return_convergence_delta=True)
    assert (delta.abs() / logits.abs()).max() > 1e-6
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "relative_position_bias_table" in name:
                parameter.zero_()
    logits = model(x).logits[:, 1].detach()
    _, delta = RuleGradientXInput(model, identity_softmax).attribute(x, target=1, return_tokens=True,
                                                                     return_convergence_delta=True)
    assert (delta.abs() / logits.abs()).max() <= 1e-12
    gi = ConservativeLRP(model, "GI").attribute(x, target=1, return_tokens=True).sum(-1)
    assert ((gi - logits).abs() / logits.abs()).median() > 1e-3


def test_ah_ln_conserves_on_a_bias_free_swinv2():
    # Swin v2's continuous position bias and cosine scores sit behind the constant gate (AH).
    model = _bias_free_relu_swin(version=2)
    x = _images(batch=4, size=(36, 44), dtype=F64)
    logits = model(x).logits[:, 1].detach()
    relevance, delta = ConservativeLRP(model).attribute(x, target=1, return_tokens=True,
                                                        return_convergence_delta=True)
    assert ((relevance.sum(-1) - logits).abs() / logits.abs()).max() <= 1e-12
    assert (delta.abs() / logits.abs()).max() <= 1e-12


@VERSIONS
@pytest.mark.parametrize("method", [AttnLRP, TransformerLRP, ConservativeLRP], ids=lambda m: m.__name__)
def test_lrp_methods_map_onto_pixels_and_batch(method, version):
    model = hf_swin(version=version)
    x = _images(size=(36, 44))
    maps = method(model).attribute(x, target=[0, 1, 2])
    assert maps.shape == x.shape and torch.isfinite(maps).all()
    tokens = method(model).attribute(x, target=[0, 1, 2], return_tokens=True)
    single = method(model).attribute(x[1:2], target=1, return_tokens=True)
    torch.testing.assert_close(tokens[1:2], single, rtol=1e-4, atol=1e-6)
