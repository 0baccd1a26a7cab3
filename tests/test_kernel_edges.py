"""Edges of the memory-saving kernels, found in review.

1. The alpha-beta linear rule over several row chunks equals the rule over all rows at
   once (both rule variants, and ``addmm`` with a bias that has one row per example).
2. An HF attention computed outside the autograd graph is refused with a CaptureError
   (the kernel reports no gradient for it), not silently given a zero gradient.
3. ``softmax_attention`` never writes into a tensor of the caller, even when the scores
   function returns one of its inputs.
"""
from __future__ import annotations

import pytest
import torch

from captum_transformers import CaptureError, GenericAttention, RuleSet
from captum_transformers.propagation.rules import linear as linear_rule
from captum_transformers.propagation.attention.core import softmax_attention
from captum_transformers.propagation.rules.operations import OperationRules
from hf_models import CASES


def _linear_layer(func):
    """A linear layer's output (``F.linear``, or ``addmm(M, x, W^T)`` with M holding one bias
    row per input row), its input and an output seed, in float64."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 6, generator=generator, dtype=torch.float64).requires_grad_()
    weight = torch.randn(5, 6, generator=generator, dtype=torch.float64)
    bias = torch.randn(5, generator=generator, dtype=torch.float64)
    row_bias = torch.randn(18, 5, generator=generator, dtype=torch.float64)

    def output():
        if func == "linear":
            return torch.nn.functional.linear(x, weight, bias)
        return torch.addmm(row_bias, x.reshape(18, 6), weight.t())

    return output, x


def _gradient(func, rules=None):
    output, x = _linear_layer(func)
    if rules is None:
        y = output()
    else:
        with OperationRules(rules, 2):
            y = output()
    seed = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)
    return torch.autograd.grad(y, x, seed)[0]


@pytest.mark.parametrize("rules", [RuleSet.CHEFER, RuleSet.LRP, RuleSet(name="gamma", linear="gamma", gamma=0.25),
                                   RuleSet(name="generalized gamma", linear="generalized_gamma", gamma=0.25)],
                         ids=lambda r: r.name)
@pytest.mark.parametrize("func", ["linear", "addmm"])
def test_linear_rule_in_row_chunks_equals_all_rows(monkeypatch, rules, func):
    whole = _gradient(func, rules)
    monkeypatch.setattr(linear_rule, "_CHUNK_ELEMENTS", 12)  # 2 rows per chunk: 9 chunks
    chunked = _gradient(func, rules)
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=1e-14)
    assert whole.abs().max() > 1e-3
    assert not torch.allclose(_gradient(func), whole)  # the rule is not the gradient: the check can fail


def test_hf_attention_outside_the_graph_is_refused():
    case = CASES["bert"]
    model = case.model()
    inputs, kwargs = case.inputs()
    layer = model.bert.encoder.layer[0].attention.self

    def no_grad_forward(original):
        def forward(*args, **kw):
            with torch.no_grad():
                return original(*args, **kw)
        return forward

    layer.forward = no_grad_forward(layer.forward)
    try:
        with pytest.raises(CaptureError, match="does not require grad"):
            GenericAttention(model).attribute(inputs, target=0, forward_kwargs=kwargs)
    finally:
        del layer.forward


def test_softmax_attention_leaves_the_callers_tensors_alone():
    generator = torch.Generator().manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=generator).requires_grad_()  # noqa: E731
    query, key, value, given_scores = make(1, 2, 3, 4), make(1, 2, 3, 4), make(1, 2, 3, 4), make(1, 2, 3, 3)
    before = given_scores.detach().clone()
    with OperationRules(RuleSet.CHEFER, 1):
        output, _ = softmax_attention(lambda q, k, scores: scores, query, key, value, given_scores)
    output.sum().backward()
    assert torch.equal(given_scores.detach(), before)
    assert given_scores.grad is not None and given_scores.grad.abs().max() > 0


# == review: a propagation entered by the caller around a method ==================================
def _timm_vit():
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
    return model.double().eval(), torch.randn(2, 3, 32, 32, dtype=torch.float64)


def _mha_encoder():
    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
            self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = torch.nn.Linear(16, 5)

        def forward(self, x):
            return self.head(self.encoder(x)[:, 0])

    torch.manual_seed(0)
    return Encoder().double().eval(), torch.randn(2, 6, 16, dtype=torch.float64)


@pytest.mark.parametrize("build", [_timm_vit, _mha_encoder], ids=["timm", "torch_mha"])
def test_method_inside_a_callers_propagation_sees_the_rules(build):
    """Propagation entered first, the capture inside it: one interception serves both, the
    map is still recorded, and the rules change the map's gradient (hence the result)."""
    from captum_transformers import get_adapter

    pytest.importorskip("timm")
    model, x = build()
    rules = RuleSet(name="uniform-identity", matmul="uniform", softmax="identity")
    plain = GenericAttention(model).attribute(x, target=[1, 3])
    with get_adapter(model).propagation(model, rules):
        inside = GenericAttention(model).attribute(x, target=[1, 3])
    assert torch.isfinite(inside).all() and inside.abs().max() > 0
    assert not torch.allclose(inside, plain)


def test_timm_ah_propagation_around_a_capture_keeps_the_detached_gate():
    from captum_transformers import get_adapter

    pytest.importorskip("timm")
    model, x = _timm_vit()
    with get_adapter(model).propagation(model, RuleSet.AH):
        with pytest.raises(CaptureError, match="No gradient reached"):  # A V sees a constant map
            GenericAttention(model).attribute(x, target=[1, 3])


def test_linear_rule_takes_keyword_weights():
    """EVA and BEiT call F.linear(x, weight=..., bias=...)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 6, generator=generator, dtype=torch.float64)
    bias = torch.randn(5, generator=generator, dtype=torch.float64)
    seed = torch.linspace(-1, 1, 20, dtype=torch.float64).reshape(4, 5)
    grads = []
    for call in (lambda: torch.nn.functional.linear(x, weight, bias),
                 lambda: torch.nn.functional.linear(x, weight=weight, bias=bias)):
        with OperationRules(RuleSet.CHEFER, 4):
            grads.append(torch.autograd.grad(call(), x, seed)[0])
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
    assert not torch.allclose(grads[0], torch.autograd.grad(torch.nn.functional.linear(x, weight, bias), x, seed)[0])


def test_masked_timm_attention_keeps_no_per_layer_bias():
    """A boolean mask is applied inside the recomputed scores: the layers share the caller's
    mask instead of each keeping a float (B, 1, N, N) bias."""
    from captum_transformers import get_adapter

    pytest.importorskip("timm")
    model, x = _timm_vit()
    x.requires_grad_()
    tokens = 17
    mask = torch.ones(2, 1, tokens, tokens, dtype=torch.bool)
    mask[1, ..., -3:] = False
    sizes = []

    def pack(tensor):
        sizes.append((tensor.dtype, tensor.numel()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), \
            get_adapter(model).propagation(model, RuleSet.CHEFER):
        model(x, attn_mask=mask)
    assert (torch.float64, mask.numel()) not in sizes
