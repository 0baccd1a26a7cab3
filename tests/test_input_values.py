"""Inputs whose values or provenance no explanation can use as given.

* Tensors made under ``torch.inference_mode()`` raised torch's "Inference tensors cannot be
  saved for backward": they are explained exactly, as ordinary copies (equal maps).
* A caller inside ``torch.inference_mode()`` is refused, saying gradients cannot be enabled there.
* NaN or +/-inf in an input was blamed on ``query_rows`` or on the model's precision ("explain a
  float32 copy"): the refusal now names the input, the counts and the examples.
"""
from __future__ import annotations

import pytest
import torch

import captum_transformers as ct
from captum_transformers.errors import InputError
from captum_transformers.methods.catalog import METHOD_FACTORIES
from captum_transformers.engine.runner import run_trace
from hf_models import CASES
from tiny_models import timm_vit_case

METHODS = ["generic-attention", "rollout", "attn-lrp", "transformer-relevance", "saliency"]


def _inference_copy(value):
    with torch.inference_mode():
        return value.clone()


@pytest.mark.parametrize("method", METHODS)
def test_token_ids_and_mask_made_in_inference_mode_are_explained_exactly(method):
    spec = CASES["bert"]
    model = spec.model()
    ids, kwargs = spec.inputs()
    expected = METHOD_FACTORIES[method](model).attribute(ids, target=1, forward_kwargs=kwargs, return_tokens=True)
    frozen_ids, frozen_mask = _inference_copy(ids), _inference_copy(kwargs["attention_mask"])
    assert frozen_ids.is_inference()
    got = METHOD_FACTORIES[method](model).attribute(frozen_ids, target=1,
                                                    forward_kwargs={"attention_mask": frozen_mask}, return_tokens=True)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("method", METHODS)
def test_pixels_made_in_inference_mode_are_explained_exactly(method):
    model, pixels, _ = timm_vit_case()
    expected = METHOD_FACTORIES[method](model).attribute(pixels, target=1)
    got = METHOD_FACTORIES[method](model).attribute(_inference_copy(pixels), target=1)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_mapping_of_inference_tensors_and_a_positional_mask_are_explained_exactly():
    spec = CASES["bert"]
    model = spec.model()
    ids, kwargs = spec.inputs()
    expected = ct.AttnLRP(model).attribute(ids, target=1, additional_forward_args=kwargs["attention_mask"],
                                           return_tokens=True)
    by_position = ct.AttnLRP(model).attribute(_inference_copy(ids), target=1, return_tokens=True,
                                              additional_forward_args=_inference_copy(kwargs["attention_mask"]))
    batch = {"input_ids": _inference_copy(ids), "attention_mask": _inference_copy(kwargs["attention_mask"])}
    by_name = ct.AttnLRP(model).attribute(batch, target=1, return_tokens=True)
    torch.testing.assert_close(by_position, expected, rtol=0, atol=0)
    torch.testing.assert_close(by_name, expected, rtol=0, atol=0)


@pytest.mark.parametrize("method", METHODS)
def test_a_caller_inside_inference_mode_is_refused_clearly(method):
    model, pixels, _ = timm_vit_case()
    with torch.inference_mode(), pytest.raises(InputError, match="inference_mode") as caught:
        METHOD_FACTORIES[method](model).attribute(pixels, target=1)
    assert "gradients cannot be enabled" in str(caught.value) and "torch.no_grad()" in str(caught.value)


@pytest.mark.parametrize("value, named", [(float("nan"), "2 NaN"), (float("inf"), "2 +inf"),
                                          (float("-inf"), "2 -inf")])
@pytest.mark.parametrize("method", METHODS)
def test_non_finite_pixels_are_refused_naming_the_input_and_the_count(method, value, named):
    model, pixels, _ = timm_vit_case()
    pixels = pixels.clone()
    pixels[1, 0, 3, 4] = value
    pixels[2, 2, 0, 0] = value
    with pytest.raises(InputError) as caught:
        METHOD_FACTORIES[method](model).attribute(pixels, target=1)
    message = str(caught.value)
    assert message.startswith("Input 0 (shape (3, 3, 32, 32), torch.float32)")
    assert f"holds {named} of its 9216 entries" in message and "example(s) 1, 2" in message
    assert "query_rows" not in message and "float32 copy" not in message


def test_nan_in_a_mapping_input_is_named_by_its_key():
    spec = CASES["bert"]
    model = spec.model()
    ids, kwargs = spec.inputs()
    embeds = model.get_input_embeddings()(ids).detach()
    embeds[0, 2, :3] = float("nan")
    embeds[0, 3, 0] = float("inf")
    with pytest.raises(InputError, match=r"Inputs\['inputs_embeds'\] \(shape \(3, 7, 32\), torch.float32\) holds "
                                         r"3 NaN, 1 \+inf of its 672 entries \(example\(s\) 0 along"):
        ct.GenericAttention(model).attribute({"inputs_embeds": embeds, **kwargs}, target=1)


def test_an_adapter_called_directly_refuses_nan_too():
    model, pixels, _ = timm_vit_case()
    pixels = pixels.clone()
    pixels[0, 0, 0, 0] = float("nan")
    method = ct.GenericAttention(model)
    with pytest.raises(InputError, match=r"Input 0 .* holds 1 NaN"):
        run_trace(method.adapter, model, (pixels,), (), 1, method.capture_spec())
