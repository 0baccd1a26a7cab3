"""Another library's patches (LXT-style) are refused or reported, never explained through silently.

Class methods replaced in the process (``Class.forward = other_function``) are refused with a
CaptureError naming the method, the replacement and how to undo it; a replaced kernel or mask
entry under the package's own attention key is refused; replaced "eager" / "sdpa" entries are
reported once by a warning, and the maps stay those of the unpatched process.
Every patch is applied inside a test and undone in ``finally``.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from unittest import mock

import pytest
import torch
from torch import nn

from captum_transformers import CaptureError
from captum_transformers.adapters import base as adapter_base
from captum_transformers.adapters.huggingface import kernel as hf_kernel
from captum_transformers.methods.catalog import (CAPTUM_BASELINES, METHOD_FACTORIES, METHOD_NAMES,
                                                 PACKAGE_METHOD_NAMES)
from hf_models import CASES
from tiny_models import EncoderClassifier, timm_vit_case

transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")
from timm.layers import Mlp  # noqa: E402
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402
from transformers.models.bert.modeling_bert import BertIntermediate  # noqa: E402

TARGETS = [0, 1, 2]




def _hf():
    inputs, kwargs = CASES["bert"].inputs()
    return CASES["bert"].model(), inputs, kwargs


_timm = timm_vit_case


def _torch_mha():
    torch.manual_seed(0)
    ids = torch.randint(0, 20, (3, 6))
    return EncoderClassifier().eval(), ids, {}


def half_gradient_forward(self, x, *args, **kwargs):
    """Same values as the identity-like original, half the gradient: what a rule library does."""
    y = _ORIGINALS[type(self)](self, x, *args, **kwargs)
    return y.detach() + 0.5 * (y - y.detach())


_ORIGINALS = {}


@contextlib.contextmanager
def replaced(cls, name, make):
    original = vars(cls)[name]
    _ORIGINALS[cls] = original
    setattr(cls, name, make(original))
    try:
        yield
    finally:
        setattr(cls, name, original)
        _ORIGINALS.pop(cls, None)


# (model factory, library class it uses, how the patch is made)
PATCHES = {
    "huggingface-BertIntermediate.forward": (_hf, BertIntermediate, lambda original: half_gradient_forward),
    "timm-Mlp.forward": (_timm, Mlp, lambda original: half_gradient_forward),
    "torch_mha-Dropout.forward(partial)": (_torch_mha, nn.Dropout,
                                           lambda original: functools.partialmethod(half_gradient_forward)),
}


@pytest.mark.parametrize("method", METHOD_NAMES)
@pytest.mark.parametrize("case", sorted(PATCHES))
def test_a_replaced_library_method_is_refused_by_every_method(case, method):
    build, cls, make = PATCHES[case]
    model, inputs, kwargs = build()
    if method in CAPTUM_BASELINES and not inputs.is_floating_point() and not hasattr(model, "get_input_embeddings"):
        pytest.skip(f"{method} needs get_input_embeddings() for token ids")
    explainer = METHOD_FACTORIES[method](model)
    with replaced(cls, "forward", make):
        with pytest.raises(CaptureError) as error:
            explainer.attribute(inputs, target=TARGETS, forward_kwargs=kwargs)
    message = str(error.value)
    assert f"{cls.__qualname__}.forward" in message and "half_gradient_forward" in message
    assert "another library replaced it" in message and "Undo the patch" in message
    explainer.attribute(inputs, target=TARGETS, forward_kwargs=kwargs)  # undone: explained again


def test_a_non_function_class_attribute_replaced_by_a_foreign_function_is_refused(monkeypatch):
    """Verified once, a class is re-checked when any entry of its dict changes, not only the
    functions it had: a plain attribute turned into a foreign function (dict size unchanged)."""
    model, inputs, kwargs = _hf()
    explainer = METHOD_FACTORIES["transformer-relevance"](model)
    explainer.attribute(inputs, target=TARGETS, forward_kwargs=kwargs)  # BertIntermediate verified
    assert not callable(vars(BertIntermediate).get("__doc__"))
    monkeypatch.setattr(BertIntermediate, "__doc__", half_gradient_forward)
    with pytest.raises(CaptureError, match=r"BertIntermediate\.__doc__ is .*half_gradient_forward"):
        explainer.attribute(inputs, target=TARGETS, forward_kwargs=kwargs)


def test_the_replacement_would_have_changed_the_maps_silently():
    """Why refusing matters: the forward values stay the same, the maps do not."""
    model, inputs, kwargs = _hf()
    explainer = METHOD_FACTORIES["generic-attention"](model)
    clean = explainer.attribute(inputs, target=TARGETS, forward_kwargs=kwargs, return_tokens=True)
    with torch.no_grad():
        clean_logits = model(inputs, **kwargs).logits
    with replaced(BertIntermediate, "forward", lambda original: half_gradient_forward), \
            mock.patch.object(adapter_base, "check_library_classes", lambda model: None):
        with torch.no_grad():
            assert torch.equal(model(inputs, **kwargs).logits, clean_logits)
        unchecked = explainer.attribute(inputs, target=TARGETS, forward_kwargs=kwargs, return_tokens=True)
    assert not torch.allclose(unchecked, clean)


@contextlib.contextmanager
def registry_entry(registry, key, function):
    had = key in registry._local_mapping
    previous = registry._local_mapping.get(key)
    registry[key] = function
    try:
        yield
    finally:
        if had:
            registry._local_mapping[key] = previous
        else:
            del registry[key]


def foreign_kernel(module, query, key, value, attention_mask, **kwargs):
    return hf_kernel.captum_attention(module, query, key, value, attention_mask, **kwargs)


def foreign_mask(*args, **kwargs):
    return ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["eager"](*args, **kwargs)


@pytest.mark.parametrize("method", PACKAGE_METHOD_NAMES)  # Captum's own methods never run the kernel
@pytest.mark.parametrize("registry_name", ["ALL_ATTENTION_FUNCTIONS", "ALL_MASK_ATTENTION_FUNCTIONS"])
def test_a_replaced_entry_under_the_kernel_key_is_refused(registry_name, method):
    model, inputs, kwargs = _hf()
    explainer = METHOD_FACTORIES[method](model)
    explainer.attribute(inputs, target=TARGETS, forward_kwargs=kwargs)  # registers the kernel
    registry, function = ((ALL_ATTENTION_FUNCTIONS, foreign_kernel) if registry_name == "ALL_ATTENTION_FUNCTIONS"
                          else (ALL_MASK_ATTENTION_FUNCTIONS, foreign_mask))
    with registry_entry(registry, hf_kernel.ATTENTION_KEY, function):
        with pytest.raises(CaptureError) as error:
            explainer.attribute(inputs, target=TARGETS, forward_kwargs=kwargs)
    message = str(error.value)
    assert f"{registry_name}['captum_transformers']" in message and function.__qualname__ in message
    assert "del " in message


def foreign_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    output, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return output * 2, weights  # visibly different: the model's own forward changes


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_replaced_eager_or_sdpa_entries_are_reported_once_and_leave_the_maps_alone(implementation):
    model, inputs, kwargs = CASES["bert"].model(implementation), *CASES["bert"].inputs()
    explainers = [METHOD_FACTORIES[name](model) for name in ("generic-attention", "attn-lrp")]
    clean = [e.attribute(inputs, target=TARGETS, forward_kwargs=kwargs, return_tokens=True) for e in explainers]
    with registry_entry(ALL_ATTENTION_FUNCTIONS, implementation, foreign_attention):
        with pytest.warns(UserWarning, match=rf"ALL_ATTENTION_FUNCTIONS\['{implementation}'\] was replaced by "
                                             r".*foreign_attention.*Explanations are unaffected.*del "):
            got = [e.attribute(inputs, target=TARGETS, forward_kwargs=kwargs, return_tokens=True) for e in explainers]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            explainers[0].attribute(inputs, target=TARGETS, forward_kwargs=kwargs)  # reported once
    for before, after in zip(clean, got):
        torch.testing.assert_close(after, before, rtol=0, atol=0)


def _kernels_function(qualname):
    """A function as the ``kernels`` library (transformers >= 5.25's dependency) defines it."""
    def function(*args, **kwargs):
        return None
    function.__module__, function.__qualname__ = "kernels._internals.layer.layer", qualname
    return function


def test_transformers_own_hub_kernel_registrations_are_not_refused_but_a_kernel_forward_is(monkeypatch):
    """transformers 5.25 registers hub kernels on its classes through ``kernels`` when it defines
    them (``kernel_condition``; an ``__init__`` wrapper): they change nothing until
    ``kernelize`` replaces ``forward``, so they are accepted; a forward from ``kernels`` is not."""
    model, inputs, kwargs = _hf()
    explainer = METHOD_FACTORIES["generic-attention"](model)
    clean = explainer.attribute(inputs, target=TARGETS, forward_kwargs=kwargs)
    monkeypatch.setattr(BertIntermediate, "kernel_condition",
                        _kernels_function("replace_kernel_forward_from_hub.<locals>.<lambda>"), raising=False)
    original_init = BertIntermediate.__init__
    wrapped = _kernels_function("use_kernelized_func.<locals>.decorator.<locals>.new_init")
    monkeypatch.setattr(BertIntermediate, "__init__", functools.wraps(original_init)(wrapped))
    BertIntermediate.__init__.__module__ = "kernels._internals.layer.layer"
    BertIntermediate.__init__.__qualname__ = "use_kernelized_func.<locals>.decorator.<locals>.new_init"
    assert torch.equal(explainer.attribute(inputs, target=TARGETS, forward_kwargs=kwargs), clean)
    monkeypatch.setattr(BertIntermediate, "forward", _kernels_function("kernelized_forward"))
    with pytest.raises(CaptureError, match=r"BertIntermediate\.forward is kernels\."):
        explainer.attribute(inputs, target=TARGETS, forward_kwargs=kwargs)
