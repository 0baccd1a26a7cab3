"""Image and audio encoders with inline softmax attention, observed by the same rows as the text
families (``adapters/huggingface/inline_text.py``): Data2Vec-Vision (BEiT's attention with its
relative position bias) and SEW-D (DeBERTa-v2's disentangled attention). The captured maps equal
the model's own eager ``output_attentions`` (1e-12, float64), the model is restored after every
method, and the families that are not explained are refused by name (LeViT, MobileViT, WavLM)
or as not applicable (MobileViT v2, SwiftFormer)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.coverage import shrink  # noqa: E402
from benchmarks.coverage.media import media_inputs  # noqa: E402
from captum_transformers import CaptureSpec  # noqa: E402
from captum_transformers.adapters import HuggingFaceAdapter  # noqa: E402
from captum_transformers.capture.recorder import Recorder  # noqa: E402
from captum_transformers.errors import NotSoftmaxAttentionError, UnsupportedModelError  # noqa: E402
from captum_transformers.methods.catalog import build_method  # noqa: E402
from restore import assert_same, snapshot  # noqa: E402

KEEP = CaptureSpec(forward_reduce=lambda probs: probs)
OBSERVED = {"data2vec-vision": ("Data2VecVisionForImageClassification", "image-classification"),
            "sew-d": ("SEWDForSequenceClassification", "audio-classification")}


def _built(model_type, class_name, head):
    model = shrink.build_model(shrink.small_config(model_type, class_name, head), class_name)
    name, inputs, _ = media_inputs(model, 1)
    return model, (name, inputs)


@pytest.mark.parametrize("model_type", sorted(OBSERVED))
def test_captured_maps_equal_eager_output_attentions_and_every_method_restores(model_type):
    model, (name, inputs) = _built(model_type, *OBSERVED[model_type])
    with torch.no_grad():
        reference = list(model(**{name: inputs}, output_attentions=True).attentions)
    recorder = Recorder(KEEP)
    HuggingFaceAdapter().captured_forward(model, (inputs,), (), None, recorder)
    maps = [site.forward_value for site in recorder.sites]
    assert len(maps) == len(reference) == model.config.num_hidden_layers
    for ours, theirs in zip(maps, reference):
        assert ours.dtype == torch.float64 and ours.shape == theirs.shape
        assert (ours - theirs).abs().max() <= 1e-12
    before = snapshot(model)
    for method in ("raw-attention", "generic-attention", "attn-lrp", "conservative-lrp"):
        result = build_method(method, model).attribute(inputs, target=1)
        assert result.shape == inputs.shape and bool(result.abs().sum() > 0), method
        assert_same(before, snapshot(model))


@pytest.mark.parametrize("model_type,class_name,head,error,named", [
    ("levit", "LevitForImageClassification", "image-classification", UnsupportedModelError, "LeViT"),
    ("mobilevit", "MobileViTForImageClassification", "image-classification", UnsupportedModelError, "MobileViT"),
    ("wavlm", "WavLMForSequenceClassification", "audio-classification", UnsupportedModelError, "WavLM"),
    ("mobilevitv2", "MobileViTV2ForImageClassification", "image-classification", NotSoftmaxAttentionError,
     "separable self-attention"),
    ("swiftformer", "SwiftFormerForImageClassification", "image-classification", NotSoftmaxAttentionError,
     "efficient additive attention"),
])
def test_families_not_explained_are_refused_by_name(model_type, class_name, head, error, named):
    model, (_, inputs) = _built(model_type, class_name, head)
    for method in ("raw-attention", "attn-lrp"):
        with pytest.raises(error, match=named):
            build_method(method, model).attribute(inputs, target=1)
    assert build_method("integrated-gradients", model).attribute(inputs, target=1).shape == inputs.shape
