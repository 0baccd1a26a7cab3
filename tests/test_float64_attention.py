"""float64 models: the HF kernel computes attention in the model's own precision.

The kernel once ran every softmax in float32, so a float64 model's captured maps were a
float32 rounding of its own (1e-8 off) and full LRP drifted further (up to 2e-2 on a
12-layer BERT). The softmax now runs in ``promote_types(dtype, float32)``.
"""
from __future__ import annotations

import pytest
import torch

from captum_transformers import get_adapter
from captum_transformers.capture.trace import CaptureSpec
from captum_transformers.engine.runner import run_trace
from hf_models import CASES

RAW = CaptureSpec(forward_reduce=lambda probs: probs)
# Models whose own eager kernel runs the softmax in the model's dtype (ViT, CLIP and Llama
# cast to float32 there, so their eager maps are not a float64 reference).
SAME_DTYPE_EAGER = ["bert", "roberta", "distilbert", "gpt2"]


def _captured(model, inputs, kwargs):
    adapter = get_adapter(model)
    return run_trace(adapter, model, (inputs,), (), 0, RAW, kwargs)  # target 0: bare encoders need one


@pytest.mark.parametrize("name", SAME_DTYPE_EAGER)
def test_float64_maps_equal_the_models_own_eager_maps(name):
    spec = CASES[name]
    model = spec.model("eager", dtype=torch.float64)
    inputs, kwargs = spec.inputs()
    with torch.no_grad():
        own = model(inputs, output_attentions=True, **kwargs)
    records = _captured(model, inputs, kwargs).records
    assert len(records) == len(own.attentions)
    for record, reference in zip(records, own.attentions):
        assert record.forward_value.dtype == torch.float64
        torch.testing.assert_close(record.forward_value, reference, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", sorted(CASES))
def test_float64_capture_keeps_the_models_float64_output(name):
    """The captured forward's logits equal the model's own SDPA forward (float64 throughout)."""
    spec = CASES[name]
    model = spec.model("sdpa", dtype=torch.float64)
    inputs, kwargs = spec.inputs(dtype=torch.float64)
    with torch.no_grad():
        own = model(inputs, **kwargs)
    captured = _captured(model, inputs, kwargs).logits
    expected = own[0] if isinstance(own, tuple) else getattr(own, "logits", None)
    if expected is None:
        expected = own.image_embeds if hasattr(own, "image_embeds") else own.text_embeds
    if captured.shape != expected.shape:  # causal LMs: the explained next-token logits
        expected = expected[:, -1] if kwargs.get("attention_mask") is None else expected[
            torch.arange(expected.shape[0]), kwargs["attention_mask"].sum(1) - 1]
    torch.testing.assert_close(captured, expected, rtol=0, atol=1e-12)
