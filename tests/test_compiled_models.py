"""``torch.compile``-d models, and models with compiled parts, are explained as their original
modules: the maps equal those of the uncompiled model, a one-time warning says so, and the
compiled model is left compiled.

Before, a compiled timm ViT gave an all-zero TransformerRelevance map and a compiled
nn.TransformerEncoder model was off by 1.5e-3: the compiled graph does not see the hooks,
wrapped forwards and torch-function modes the explanation relies on.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from captum_transformers import InputError
from captum_transformers.methods.catalog import METHOD_FACTORIES, METHOD_NAMES
from hf_models import CASES
from tiny_models import EncoderClassifier, timm_vit_case

timm = pytest.importorskip("timm")

TARGETS = [0, 1, 2]




_timm = timm_vit_case


def _torch_mha():
    torch.manual_seed(0)
    ids = torch.randint(0, 20, (3, 6))
    padding = torch.zeros(3, 6, dtype=torch.bool)
    padding[1, 4:] = True
    return EncoderClassifier().eval(), ids, {"key_padding_mask": padding}


def _hf():
    inputs, kwargs = CASES["bert"].inputs()
    return CASES["bert"].model(), inputs, kwargs


MODELS = {"timm": _timm, "torch_mha": _torch_mha, "huggingface": _hf}


def _compile_whole(model):
    return torch.compile(model, backend="eager")


def _compile_part(model):
    """The attention stack compiled as a submodule (torch.compile(submodule) assigned back)."""
    for name in ("blocks", "encoder", "bert"):
        if hasattr(model, name):
            setattr(model, name, torch.compile(getattr(model, name), backend="eager"))
            return model
    raise AssertionError("no part to compile")


def _compile_in_place(model):
    """nn.Module.compile(): the module stays itself, its __call__ goes through compiled code."""
    model.compile(backend="eager")
    return model


HOW = {"torch.compile(model)": _compile_whole, "torch.compile(part)": _compile_part,
       "model.compile()": _compile_in_place}


def _maps(model, inputs, kwargs, method):
    # Captum's pixel methods have no tokens to return: compare their pixel maps.
    tokens = not (method in ("integrated-gradients", "saliency") and inputs.is_floating_point())
    return METHOD_FACTORIES[method](model).attribute(inputs, target=TARGETS, forward_kwargs=kwargs,
                                                     return_tokens=tokens)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("how", sorted(HOW))
@pytest.mark.parametrize("adapter", sorted(MODELS))
def test_compiled_models_are_explained_as_the_original(adapter, how):
    model, inputs, kwargs = MODELS[adapter]()
    compiled = HOW[how](copy.deepcopy(model))
    with torch.no_grad():
        compiled_output = compiled(inputs, **kwargs)  # compiled code exists before the explanation
    for method in METHOD_NAMES:
        try:
            expected = _maps(model, inputs, kwargs, method)
        except InputError as refusal:  # Captum's baselines on ids of a model without get_input_embeddings()
            assert method in ("integrated-gradients", "saliency"), refusal
            with pytest.raises(InputError, match="get_input_embeddings"):
                _maps(compiled, inputs, kwargs, method)
            continue
        got = _maps(compiled, inputs, kwargs, method)
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=lambda m: f"{method}: {m}")
    with torch.no_grad():
        after = compiled(inputs, **kwargs)
    first = (lambda out: out if isinstance(out, torch.Tensor) else out[0])
    assert torch.equal(first(after), first(compiled_output))  # still the compiled model


def test_compiled_timm_transformer_relevance_is_not_all_zero():
    model, inputs, _ = _timm()
    compiled = torch.compile(copy.deepcopy(model), backend="eager")
    maps = _maps(compiled, inputs, {}, "transformer-relevance")
    assert maps.abs().sum(-1).min() > 0
    torch.testing.assert_close(maps, _maps(model, inputs, {}, "transformer-relevance"), rtol=0, atol=0)


def test_one_warning_per_model_names_the_compiled_parts_and_the_model_stays_compiled():
    model, inputs, kwargs = _torch_mha()
    compiled = _compile_part(model)
    forward = compiled.encoder.forward
    explainer = METHOD_FACTORIES["generic-attention"](compiled)
    with pytest.warns(UserWarning, match=r"torch\.compile-d parts \(encoder\).*original \(uncompiled\)"):
        explainer.attribute(inputs, target=TARGETS, forward_kwargs=kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        explainer.attribute(inputs, target=TARGETS, forward_kwargs=kwargs)  # no second warning
    assert compiled.encoder.forward is forward and "forward" in vars(compiled.encoder)
    assert type(compiled.encoder).__name__ == "OptimizedModule"


def test_in_place_compiled_module_keeps_its_compiled_call():
    model, inputs, kwargs = _timm()
    model.compile(backend="eager")
    compiled_call = model._compiled_call_impl
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _maps(model, inputs, kwargs, "generic-attention")
    assert model._compiled_call_impl is compiled_call


def test_inductor_compiled_timm_vit():
    pytest.importorskip("torch._inductor")
    model, inputs, _ = _timm()
    compiled = torch.compile(copy.deepcopy(model))  # the default backend: inductor
    try:
        with torch.no_grad():
            compiled(inputs)
    except Exception as error:  # no C++ toolchain on this machine: nothing to compare with
        pytest.skip(f"inductor cannot compile here: {type(error).__name__}")
    for method in ("generic-attention", "transformer-relevance"):
        torch.testing.assert_close(_maps(compiled, inputs, {}, method), _maps(model, inputs, {}, method),
                                   rtol=0, atol=0)
