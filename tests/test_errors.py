"""Bad input gets a clear error naming what was received and how to fix it."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import captum_transformers as ct
from captum_transformers import (ATTENTION_METHODS, CaptureError, GenericAttention, InputError,
                                 UnsupportedModelError)
from hf_models import CASES
from restore import assert_same, snapshot


def test_import_does_not_pull_optional_dependencies():
    code = ("import sys, captum_transformers; "
            "print([m for m in ('transformers', 'timm', 'torch_geometric') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


class Unknown(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x):
        return self.linear(x)


@pytest.mark.parametrize("method", ATTENTION_METHODS, ids=lambda m: m.__name__)
def test_unsupported_model_lists_families_and_recipe(method):
    with pytest.raises(UnsupportedModelError) as info:
        method(Unknown())
    message = str(info.value)
    assert "Unknown" in message and "huggingface" in message and "register_adapter" in message


def test_unknown_adapter_name():
    with pytest.raises(UnsupportedModelError, match="registered adapters"):
        GenericAttention(Unknown(), adapter="nope")


def test_forced_adapter_that_sees_no_attention_raises_capture_error():
    with pytest.raises(CaptureError, match="no attention"):
        GenericAttention(Unknown(), adapter="huggingface").attribute(torch.randn(2, 4), target=0)


@pytest.fixture(scope="module")
def bert():
    return CASES["bert"].model(), CASES["bert"].inputs()


@pytest.mark.parametrize("target, match", [
    (3, "out of range"), (-4, "out of range"), ([0, 1], "3 examples"), ((0, 1), "index"),
    (torch.tensor([0, 1, 2, 0]), "4 entries"), (torch.zeros(3, 1, 1, dtype=torch.long), "does not fit"), (torch.tensor([0.5]), "integers"), ("a", "not understood"),
])
def test_bad_targets(bert, target, match):
    model, (inputs, kwargs) = bert
    before = snapshot(model)
    with pytest.raises(InputError, match=match):
        GenericAttention(model).attribute(inputs, target=target, forward_kwargs=kwargs)
    assert_same(before, snapshot(model))


def test_mismatched_input_batch_sizes(bert):
    model, (inputs, kwargs) = bert
    with pytest.raises(InputError, match="same batch size"):
        GenericAttention(model).attribute((inputs, inputs[:2]), target=0)


def test_non_tensor_inputs(bert):
    model, _ = bert
    with pytest.raises(InputError, match="tensor"):
        GenericAttention(model).attribute([[1, 2, 3]], target=0)


def test_image_size_that_does_not_fit_the_patch_grid():
    spec = CASES["vit"]
    with pytest.raises(Exception) as info:
        GenericAttention(spec.model()).attribute(torch.randn(1, 3, 40, 40), target=0)
    assert "40" in str(info.value)


def test_inference_mode_is_rejected(bert):
    model, (inputs, kwargs) = bert
    with torch.inference_mode(), pytest.raises(InputError, match="inference_mode"):
        GenericAttention(model).attribute(inputs, target=0, forward_kwargs=kwargs)


@pytest.mark.parametrize("method", [ct.AttentionRollout, GenericAttention], ids=lambda m: m.__name__)
def test_start_layer_out_of_range(bert, method):
    model, (inputs, kwargs) = bert
    with pytest.raises(InputError, match="start_layer"):
        method(model, start_layer=5).attribute(inputs, target=0, forward_kwargs=kwargs)


def test_bad_head_fusion(bert):
    with pytest.raises(ValueError, match="head_fusion"):
        ct.AttentionRollout(bert[0], head_fusion="median")


def test_target_on_scalar_output():
    class Scalar(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, ids, attention_mask):
            return self.inner(ids, attention_mask=attention_mask).logits[:, 0]

    model, (inputs, kwargs) = CASES["bert"].model(), CASES["bert"].inputs()
    wrapped = Scalar(model)
    assert GenericAttention(wrapped).attribute(inputs, additional_forward_args=(kwargs["attention_mask"],)).shape == inputs.shape
    with pytest.raises(InputError, match="one score per example"):
        GenericAttention(wrapped).attribute(inputs, target=1, additional_forward_args=(kwargs["attention_mask"],))


def test_forward_kwargs_with_the_wrong_batch_say_how_to_fix(bert):
    model, (inputs, kwargs) = bert
    with pytest.raises(InputError, match="additional_forward_args"):
        GenericAttention(model).attribute(inputs[:2], target=0, forward_kwargs=kwargs)


class _DecoderClassifier(nn.Module):
    """An nn.TransformerDecoder over token embeddings, attending to a memory of other length."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(23, 16)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0,
                                                                        batch_first=True), 1)
        self.head = nn.Linear(16, 5)

    def forward(self, ids, memory):
        return self.head(self.decoder(self.embed(ids), memory)[:, 0])


@pytest.mark.parametrize("method", ATTENTION_METHODS)
def test_cross_attention_to_an_undescribed_stream_is_a_clear_error(method):
    """The adapter describes one sequence; a memory of another length is not silently dropped."""
    torch.manual_seed(0)
    model = _DecoderClassifier().eval()
    with pytest.raises(CaptureError, match="one token sequence"):
        method(model).attribute(torch.randint(0, 23, (2, 6)), target=1,
                                additional_forward_args=(torch.randn(2, 7, 16),))


def _windowed_models():
    """Tiny windowed / hierarchical vision models (constructed only: the refusal runs nothing)."""
    transformers = pytest.importorskip("transformers")
    timm = pytest.importorskip("timm")
    swin = dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4)
    return {
        "Swin": lambda: transformers.SwinForImageClassification(transformers.SwinConfig(**swin, num_labels=3)),
        "Swinv2": lambda: transformers.Swinv2ForImageClassification(transformers.Swinv2Config(**swin, num_labels=3)),
        "Donut-Swin": lambda: transformers.DonutSwinModel(transformers.DonutSwinConfig(**swin)),
        "PVT": lambda: transformers.PvtForImageClassification(transformers.PvtConfig(
            image_size=32, num_encoder_blocks=2, depths=[1, 1], sequence_reduction_ratios=[2, 1], hidden_sizes=[16, 32],
            patch_sizes=[4, 2], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2], num_labels=3)),
        "Swin v2 CR (timm)": lambda: timm.models.swin_transformer_v2_cr.SwinTransformerV2Cr(
            img_size=(32, 32), window_size=4, embed_dim=16, depths=(1, 1), num_heads=(1, 2), num_classes=3),
        "Swin (timm)": lambda: timm.models.swin_transformer.SwinTransformer(
            img_size=32, patch_size=4, embed_dim=16, depths=(1, 1), num_heads=(1, 2), window_size=4, num_classes=3),
    }


@pytest.mark.parametrize("family", ["Donut-Swin", "PVT", "Swin v2 CR (timm)"])
@pytest.mark.parametrize("method", [GenericAttention, ct.AttnLRP], ids=lambda m: m.__name__)
def test_windowed_hierarchical_models_are_refused_by_name(family, method):
    """Not a grid-mismatch CaptureError at attribute time: refused when the method is built."""
    model = _windowed_models()[family]()
    with pytest.raises(UnsupportedModelError) as info:
        method(model)
    message = str(info.value)
    assert f"a {family} model" in message and "not supported yet" in message
    if "Swin" in family:
        assert "windowed attention with cyclic shift and patch merging" in message


def test_windowed_model_inside_a_wrapper_or_with_a_named_built_in_adapter_is_refused():
    donut = _windowed_models()["Donut-Swin"]()
    with pytest.raises(UnsupportedModelError, match="contains\\) a Donut-Swin model"):
        GenericAttention(nn.Sequential(donut))
    # HF Swin is explained by the "swin" adapter (tests/test_swin.py), also inside a wrapper;
    # any other built-in adapter would read its windows as one sequence and is refused.
    swin = _windowed_models()["Swin"]()
    assert GenericAttention(nn.Sequential(swin)).adapter.name == "swin"
    with pytest.raises(UnsupportedModelError, match="only the 'swin' adapter"):
        GenericAttention(swin, adapter="huggingface")


def test_a_user_adapter_may_take_on_a_windowed_model():
    from captum_transformers.adapters.huggingface.adapter import HuggingFaceAdapter

    class MySwinAdapter(HuggingFaceAdapter):
        name = "my-swin"

    swin = _windowed_models()["Swin"]()
    assert GenericAttention(swin, adapter=MySwinAdapter()).adapter.name == "my-swin"


class _LinearPatchViT(nn.Module):
    """Patches embedded by a Linear layer (no kernel == stride convolution): no patch grid known."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(48, 16)
        self.cls = nn.Parameter(torch.randn(1, 1, 16))
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2,
                                             enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)

    def forward(self, images):
        patches = nn.functional.unfold(images, 4, stride=4).transpose(1, 2)
        tokens = torch.cat([self.cls.expand(images.shape[0], -1, -1), self.embed(patches)], dim=1)
        return self.head(self.encoder(tokens)[:, 0])


@pytest.mark.parametrize("method", [GenericAttention, ct.AttentionRollout, ct.TransformerRelevance],
                         ids=lambda m: m.__name__)
def test_image_without_a_patch_grid_gives_token_scores_as_the_error_advises(method):
    torch.manual_seed(0)
    model = _LinearPatchViT().eval()
    images = torch.randn(2, 3, 16, 16)
    with pytest.raises(CaptureError, match="no patch grid.*return_tokens=True"):
        method(model).attribute(images, target=1)
    tokens = method(model).attribute(images, target=1, return_tokens=True)
    assert tokens.shape == (2, 17) and bool(torch.isfinite(tokens).all())
