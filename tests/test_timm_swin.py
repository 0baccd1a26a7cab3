"""Swin and Swin v2 (timm): the same definitions as tests/test_swin.py through the timm hooks.

timm shifts the real grid and then pads (HF pads, then shifts): the geometry is checked
against timm's own roll, pad and partition; the methods against the dense reference of
``docs/windowed-attention.md``; the SDPA (fused) and explicit paths give the same explanation;
the LRP rules leave the forward bit-identical and AH+LN conserves on a bias-free ReLU Swin.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("timm")

from captum_transformers import (AttentionGradCAM, AttentionRollout, AttnLRP, ConservativeLRP,  # noqa: E402
                                 GenericAttention, PartialLRP, RawAttention, RuleSet, TransformerLRP,
                                 TransformerRelevance, get_adapter)
from captum_transformers.capture.windows import WindowGeometry  # noqa: E402
from restore import assert_same, raising_after, snapshot  # noqa: E402
from swin_models import F64, dense_rows, timm_swin  # noqa: E402

ATTENTION = [RawAttention, AttentionRollout, AttentionGradCAM, GenericAttention, TransformerRelevance, PartialLRP]
GRADIENT_METHODS = {AttentionGradCAM, GenericAttention, TransformerRelevance, PartialLRP}
LAST_ONLY = {RawAttention, AttentionGradCAM, PartialLRP}


def _images(batch=3, size=(32, 32), dtype=torch.float32, seed=1):
    return torch.randn(batch, 3, *size, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("grid,window,shift", [((8, 8), 4, 2), ((6, 10), 4, 2), ((5, 7), 3, 1)])
def test_geometry_is_timms_own_partition(grid, window, shift):
    from timm.models.swin_transformer import window_partition

    height, width = grid
    numbers = torch.arange(height * width, dtype=F64).reshape(1, height, width, 1)
    shifted = torch.roll(numbers, shifts=(-shift, -shift), dims=(1, 2))
    padded = torch.nn.functional.pad(shifted + 1, (0, 0, 0, (-width) % window, 0, (-height) % window)) - 1
    expected = window_partition(padded, (window, window)).reshape(-1).long()
    geometry = WindowGeometry(grid, (window, window), (shift, shift), pad_first=False)
    assert torch.equal(geometry.token_index(), expected)


VERSIONS = pytest.mark.parametrize("version", [1, 2], ids=["swin", "swinv2"])


@VERSIONS
@pytest.mark.parametrize("method", ATTENTION, ids=lambda m: m.__name__)
def test_windowed_rows_equal_the_dense_reference(method, version):
    # A 9x11 grid in windows of 4 (padded), shifted, merged once.
    model = timm_swin(image=(36, 44), dtype=F64, version=version)
    x = _images(size=(36, 44), dtype=F64)
    explainer = method(model)
    trace = explainer.trace(x, target=[0, 1, 2])
    geometries = trace.layout.windows
    assert geometries[0].grid == (9, 11) and any(g.shift != (0, 0) for g in geometries)
    values = [r.backward_value if method in GRADIENT_METHODS else r.forward_value for r in trace.records]
    if method in LAST_ONLY:
        values = [v if i == len(values) - 1 else None for i, v in enumerate(values)]

    def layer_matrix(dense):
        eye = torch.eye(dense.shape[-1], dtype=F64)
        if method is AttentionRollout:
            return (eye + dense) / (eye + dense).sum(-1, keepdim=True)
        return eye + dense if method in (GenericAttention, TransformerRelevance) else dense

    tokens = explainer.attribute(x, target=[0, 1, 2], return_tokens=True)
    torch.testing.assert_close(tokens, dense_rows(trace, values, layer_matrix), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("method", ATTENTION, ids=lambda m: m.__name__)
def test_fused_and_explicit_paths_agree_batch_single_and_restore(method):
    explicit, fused = timm_swin(fused=False), timm_swin(fused=True)
    assert get_adapter(fused).name == "timm_swin"
    x = _images()
    tokens = method(explicit).attribute(x, target=[0, 1, 2], return_tokens=True)
    torch.testing.assert_close(method(fused).attribute(x, target=[0, 1, 2], return_tokens=True), tokens,
                               rtol=1e-4, atol=1e-6)
    for i in range(3):
        single = method(fused).attribute(x[i:i + 1], target=i, return_tokens=True)
        torch.testing.assert_close(tokens[i:i + 1], single, rtol=1e-4, atol=1e-6)
    maps = method(fused).attribute(x, target=[0, 1, 2])
    assert maps.shape == x.shape and torch.isfinite(maps).all()
    with torch.no_grad():
        before_output = fused(x)
    before = snapshot(fused)
    with raising_after(get_adapter(fused).blocks(fused)[-1].module, KeyboardInterrupt()):
        with pytest.raises(KeyboardInterrupt):
            method(fused).attribute(x, target=[0, 1, 2])
    assert_same(before, snapshot(fused))
    with torch.no_grad():
        assert torch.equal(fused(x), before_output)


RULE_SETS = [RuleSet.GRADIENT, RuleSet.AH, RuleSet.AH_LN, RuleSet.CHEFER, RuleSet.LRP, RuleSet.ATTN_LRP]


@pytest.mark.parametrize("rules", RULE_SETS, ids=lambda r: r.name)
def test_forward_bit_identical_under_rules(rules):
    # The reference is the explicit path: the AH rules switch the SDPA path to it (as for timm ViT).
    model = timm_swin(fused=False)
    x = _images()
    with torch.enable_grad():
        plain = model(x)
        with get_adapter(model).propagation(model, rules):
            inside = model(x)
    assert torch.equal(plain, inside)


@VERSIONS
def test_ah_ln_conserves_on_a_bias_free_relu_swin(version):
    model = timm_swin(image=(36, 44), dtype=F64, qkv_bias=False, version=version)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.zero_()
    for module in model.modules():
        if hasattr(module, "act") and isinstance(module.act, nn.GELU):
            module.act = nn.ReLU()
    x = _images(batch=4, size=(36, 44), dtype=F64)
    logits = model(x)[:, 1].detach()
    relevance, delta = ConservativeLRP(model).attribute(x, target=1, return_tokens=True,
                                                        return_convergence_delta=True)
    assert relevance.shape == (4, 9 * 11)
    assert ((relevance.sum(-1) - logits).abs() / logits.abs()).max() <= 1e-12
    assert (delta.abs() / logits.abs()).max() <= 1e-12
    gi = ConservativeLRP(model, "GI").attribute(x, target=1, return_tokens=True).sum(-1)
    assert ((gi - logits).abs() / logits.abs()).median() > 1e-3


@pytest.mark.parametrize("rules", RULE_SETS, ids=lambda r: r.name)
def test_swinv2_forward_bit_identical_and_batch(rules):
    model = timm_swin(version=2)
    assert get_adapter(model).name == "timm_swin"
    x = _images()
    with torch.enable_grad():
        plain = model(x)
        with get_adapter(model).propagation(model, rules):
            inside = model(x)
    assert torch.equal(plain, inside)
    tokens = TransformerRelevance(model).attribute(x, target=[0, 1, 2], return_tokens=True)
    single = TransformerRelevance(model).attribute(x[2:3], target=2, return_tokens=True)
    torch.testing.assert_close(tokens[2:3], single, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("method", [AttnLRP, TransformerLRP, ConservativeLRP], ids=lambda m: m.__name__)
def test_lrp_methods_batch_and_pixels(method):
    model = timm_swin(fused=True)
    x = _images()
    assert method(model).attribute(x, target=[0, 1, 2]).shape == x.shape
    tokens = method(model).attribute(x, target=[0, 1, 2], return_tokens=True)
    torch.testing.assert_close(tokens[1:2], method(model).attribute(x[1:2], target=1, return_tokens=True),
                               rtol=1e-4, atol=1e-6)


def test_other_pools_are_refused():
    model = timm_swin()
    model.reset_classifier(3, global_pool="max")
    with pytest.raises(Exception, match="global_pool='max'"):
        GenericAttention(model).attribute(_images(), target=0)


def test_gradient_checkpointing_gives_the_plain_maps():
    model = timm_swin(fused=True)
    x = _images()
    plain = GenericAttention(model).attribute(x, target=[0, 1, 2], return_tokens=True)
    model.set_grad_checkpointing(True)
    checkpointed = GenericAttention(model).attribute(x, target=[0, 1, 2], return_tokens=True)
    torch.testing.assert_close(checkpointed, plain)
    assert all(stage.grad_checkpointing for stage in model.layers)
