"""uint8 pixel batches are refused with an InputError, never explained as all zeros.

HF ViT accepts uint8 pixels in a plain forward (it casts them), but relevance and the patch
grid are read at float pixels, so every method returned an all-zero map. The decision: refuse
(the model's own cast skips its preprocessing, so a map of it would explain an input the
model was never meant to see) with an error that says to pass float pixel values.
"""
from __future__ import annotations

import pytest
import torch

from captum_transformers import InputError
from captum_transformers.methods import ATTENTION_METHODS, LRP_ATTENTION_METHODS, RELEVANCE_METHODS
from hf_models import CASES
from test_adapter_registry import EXAMPLES

METHODS = [pytest.param(m, id=m.__name__) for m in ATTENTION_METHODS + RELEVANCE_METHODS + LRP_ATTENTION_METHODS]


def _hf_vit():
    spec = CASES["vit"]
    return spec.model(), spec.inputs()[0], {}


IMAGE_MODELS = {"huggingface_vit": _hf_vit, "timm": EXAMPLES["timm"], "detr": EXAMPLES["detr"]}


@pytest.mark.parametrize("name", sorted(IMAGE_MODELS))
@pytest.mark.parametrize("method", METHODS)
def test_uint8_pixels_are_refused(name, method):
    model, pixels, kwargs = IMAGE_MODELS[name]()
    as_bytes = (pixels - pixels.min()).div(pixels.max() - pixels.min()).mul(255).to(torch.uint8)
    with pytest.raises(InputError, match=r"torch\.uint8.*floating-point pixel values"):
        method(model).attribute(as_bytes, target=0, forward_kwargs=kwargs)


def test_hf_vit_would_run_on_uint8_pixels():
    """Why the check is needed: the model itself accepts them without complaint."""
    model, pixels, _ = _hf_vit()
    with torch.no_grad():
        assert torch.isfinite(model(pixels.clamp(0, 1).mul(255).to(torch.uint8)).logits).all()
