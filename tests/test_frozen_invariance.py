"""Every method gives the same map whatever ``requires_grad`` says on parameters and inputs.

Rule Functions apply where their operands require grad. In a frozen model the graph began
at the first tapped attention, so the first layer's residual add and ``A V`` product lost
their rules and TransformerRelevance on HF and timm ViTs moved by 77-95 % of the map's
maximum (DETR's TransformerLRP by 38 %); a float input entering the residual stream
directly changed it too. Every trace and relevance pass now runs the trainable model's
graph (parameters made to require grad reversibly, floating inputs as leaves that do), so
the trainable model's map, the one matching the authors' code, is the only map.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from captum_transformers import InputError, get_adapter
from captum_transformers.methods import ATTENTION_METHODS, LRP_ATTENTION_METHODS, RELEVANCE_METHODS
from hf_models import CASES
from restore import assert_same, raising_after, snapshot
from test_adapter_registry import EXAMPLES, TARGETS

METHODS = [pytest.param(m, id=m.__name__) for m in ATTENTION_METHODS + RELEVANCE_METHODS + LRP_ATTENTION_METHODS]


class _FloatInputEncoder(nn.Module):
    """An nn.TransformerEncoder reading float inputs directly: the input is the residual stream."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.encoder(x)[:, 0])


def _hf_vit():
    spec = CASES["vit"]
    return spec.model(), spec.inputs()[0], {}


def _float_input_encoder():
    torch.manual_seed(0)
    return _FloatInputEncoder().eval(), torch.randn(3, 6, 16), {}


MODELS = {**EXAMPLES, "huggingface_vit": _hf_vit, "float_input_encoder": _float_input_encoder}


def _first_module(model: nn.Module) -> nn.Module:
    """The patch embedding or token embedding: what fine-tuning usually freezes."""
    return next(m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Embedding, nn.TransformerEncoderLayer)))


def _freeze(model: nn.Module, how: str) -> None:
    model.requires_grad_(True)
    if how == "all":
        model.requires_grad_(False)
    elif how == "first":
        _first_module(model).requires_grad_(False)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("method", METHODS)
def test_same_map_whatever_requires_grad_says(name, method):
    model, inputs, kwargs = MODELS[name]()
    target = TARGETS.get(name, [0, 1, 2])
    explain = lambda x: method(model).attribute(x, target=target, forward_kwargs=kwargs)  # noqa: E731
    trainable = explain(inputs)
    scale = trainable.abs().max().clamp(min=1e-30)
    variants = {}
    for how in ("all", "first"):
        _freeze(model, how)
        variants[how] = explain(inputs)
    model.requires_grad_(True)
    if inputs.is_floating_point():
        variants["inputs_require_grad"] = explain(inputs.clone().requires_grad_())
    for how, attributions in variants.items():
        torch.testing.assert_close(attributions / scale, trainable / scale, rtol=0, atol=1e-6,
                                   msg=lambda text, how=how: f"{how}: {text}")


@pytest.mark.parametrize("method", METHODS)
def test_flags_come_back_and_no_gradient_accumulates(method):
    model, pixels, _ = _hf_vit()
    model.requires_grad_(False)
    model.classifier.requires_grad_(True)  # a fine-tuning setup: only the head trains
    before = snapshot(model)
    method(model).attribute(pixels, target=0)
    assert_same(before, snapshot(model))
    with raising_after(get_adapter(model).blocks(model)[-1].module, KeyboardInterrupt()):
        with pytest.raises(KeyboardInterrupt):
            method(model).attribute(pixels, target=0)
    assert_same(before, snapshot(model))
    assert all(p.grad is None for p in model.parameters())


def test_parameters_of_inference_mode_are_refused_clearly():
    with torch.inference_mode():
        model, pixels, _ = _hf_vit()
    with pytest.raises(InputError, match="inference_mode"):
        ATTENTION_METHODS[-1](model).attribute(pixels.clone(), target=0)
