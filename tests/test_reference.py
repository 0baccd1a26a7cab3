"""Each method against a slow per-example reference written from its paper.

The reference reads attention through transformers' own eager path
(``output_attentions=True``), not through our kernel, and loops over examples, layers
and heads explicitly.
"""
from __future__ import annotations

import pytest
import torch

import functools

from captum_transformers import AttentionGradCAM, AttentionRollout, GenericAttention, RawAttention
from hf_models import CASES

REFERENCE_CASES = ["bert", "vit", "deit_distilled", "gpt2"]
PREFIX_TOKENS = {"bert": 0, "vit": 1, "deit_distilled": 2, "gpt2": 0}


def _named(name, factory):
    factory.__name__ = name
    return factory


GRAD_CAM_ALL = _named("AttentionGradCAM_all", functools.partial(AttentionGradCAM, head_weights="all"))


def _eager_attentions(model, inputs, kwargs, target, causal):
    """Per-layer attention (H, N, N) and d logit / d attention for ONE example."""
    output = model(inputs, output_attentions=True, **kwargs)
    attentions = output.attentions
    for a in attentions:
        a.retain_grad()
    logits = output.logits
    if causal:
        mask = kwargs.get("attention_mask")
        position = int(mask[0].nonzero().max()) if mask is not None else logits.shape[1] - 1
        logits = logits[:, position]
    logits[0, target].backward()
    return [a[0].detach() for a in attentions], [a.grad[0] for a in attentions]


def _rows(case, inputs, kwargs):
    if case == "deit_distilled":
        return [0, 1]
    if case == "gpt2":
        mask = kwargs["attention_mask"][0]
        return [int(mask.nonzero().max())]
    return [0]


def _reference(case, method, model, inputs, kwargs, target):
    attentions, grads = _eager_attentions(model, inputs, kwargs, target, causal=case == "gpt2")
    tokens = attentions[0].shape[-1]
    heads = attentions[0].shape[0]
    eye = torch.eye(tokens)
    if method is GenericAttention:  # ICCV'21 Eq. 5-6
        relevance = eye.clone()
        for a, g in zip(attentions, grads):
            a_bar = sum(torch.clamp(g[h] * a[h], min=0) for h in range(heads)) / heads
            relevance = relevance + a_bar @ relevance
    elif method is AttentionRollout:  # Abnar & Zuidema, Ahat = 0.5 A + 0.5 I
        relevance = eye.clone()
        for a in attentions:
            relevance = (0.5 * a.mean(0) + 0.5 * eye) @ relevance
    elif method is RawAttention:
        relevance = attentions[-1].mean(0)
    elif method is GRAD_CAM_ALL:  # the authors' BERT code: heads weighted by mean gradient over real pairs
        a, g = attentions[-1], grads[-1]
        mask = kwargs.get("attention_mask")
        real = torch.arange(tokens) if mask is None else mask[0].nonzero().squeeze(1)
        # A causal query attends to no key after it: those are no pairs, like padding.
        pairs = torch.ones(len(real), len(real)).tril() if case == "gpt2" else torch.ones(len(real), len(real))
        weights = [float((g[h][real][:, real] * pairs).sum() / pairs.sum()) for h in range(heads)]
        relevance = (sum(weights[h] * a[h] for h in range(heads)) / heads).clamp(min=0)
    elif method is AttentionGradCAM:
        # The authors' ViT baseline (generate_cam_attn): for the explained row r, each head's
        # weight is its gradient averaged over r's patch columns (after the prefix tokens),
        # cam = mean_h(w_h * A[h, r, :]), then clamp(min=0); several rows are averaged.
        a, g = attentions[-1], grads[-1]
        mask = kwargs.get("attention_mask")
        columns = [k for k in range(PREFIX_TOKENS[case], tokens) if mask is None or mask[0, k]]
        rows = _rows(case, inputs, kwargs)
        cams = []
        for r in rows:
            weights = [sum(float(g[h, r, k]) for k in columns) / len(columns) for h in range(heads)]
            cams.append((sum(weights[h] * a[h, r] for h in range(heads)) / heads).clamp(min=0))
        return sum(cams) / len(rows)
    rows = _rows(case, inputs, kwargs)
    return sum(relevance[r] for r in rows) / len(rows)


@pytest.mark.parametrize("case", REFERENCE_CASES)
@pytest.mark.parametrize("method", [GenericAttention, AttentionRollout, RawAttention, AttentionGradCAM, GRAD_CAM_ALL],
                         ids=lambda m: m.__name__)
def test_vectorised_method_equals_slow_reference(case, method):
    spec = CASES[case]
    model = spec.model("eager")
    inputs, kwargs = spec.inputs(batch=3)
    targets = [1, 2, 0]
    ours = method(model).attribute(inputs, target=targets, forward_kwargs=kwargs, return_tokens=True)
    for i in range(3):
        single_kwargs = {k: v[i:i + 1] for k, v in kwargs.items()}
        expected = _reference(case, method, model, inputs[i:i + 1], single_kwargs, targets[i])
        if "attention_mask" in single_kwargs:
            expected = expected * single_kwargs["attention_mask"][0]
        torch.testing.assert_close(ours[i], expected, rtol=1e-4, atol=1e-7)


def test_generic_attention_is_class_specific():
    spec = CASES["vit"]
    model = spec.model()
    inputs, _ = spec.inputs(batch=1)
    maps = [GenericAttention(model).attribute(inputs, target=t, return_tokens=True) for t in range(3)]
    assert not torch.allclose(maps[0], maps[1]) and not torch.allclose(maps[1], maps[2])
    raw = [RawAttention(model).attribute(inputs, target=t, return_tokens=True) for t in range(2)]
    torch.testing.assert_close(raw[0], raw[1])  # class-agnostic by construction


def test_grad_cam_row_keeps_per_head_maps_only_for_images():
    # Token inputs have no prefix columns: the row weights are applied as the gradient arrives
    # and one (B, Q, K) map is kept; images keep (B, 2, H, Q, K) until the patch grid is known.
    for case, dims in (("bert", 3), ("vit", 5)):
        spec = CASES[case]
        model = spec.model("eager")
        inputs, kwargs = spec.inputs(batch=2)
        trace = AttentionGradCAM(model).trace(inputs, target=[0, 1], forward_kwargs=kwargs)
        kept = [r.backward_value for r in trace.records if r.backward_value is not None]
        assert len(kept) == 1 and kept[0].dim() == dims, case
