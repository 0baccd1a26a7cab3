"""The facts a method class declares (methods/facts.py), read through the catalog: every entry
declares them all, ``signed`` and ``class_specific`` hold on a tiny ViT, and the generation-step
kind names what the generation engine calls."""
import pytest
import torch

from captum_transformers.generation.assembly import signed_method
from captum_transformers.generation.attribution import generation_steps
from captum_transformers.generation.vision_steps import carries_into_tower
from captum_transformers.methods.base import TraceAttribution
from captum_transformers.methods.catalog import (CAPTUM_BASELINES, CLASS_AGNOSTIC, METHOD_CATALOG, METHOD_FACTORIES,
                                                 METHOD_NAMES, ON_REQUEST, SIGNED_METHODS, catalog_entry)
from captum_transformers.methods.facts import FACT_NAMES, GenerationSteps
from captum_transformers.methods.lrp import RuleGradientXInput
from captum_transformers.visualization.colors import catalog_signedness

from lrp_models import _images, _timm_vit

NAMES = sorted(METHOD_CATALOG)
TARGETS = torch.tensor([0, 1, 2])
FACT_TYPES = {"signed": bool, "class_specific": bool, "run_by_default": bool, "needs_adapter": bool,
              "generation_steps": GenerationSteps}


@pytest.fixture(scope="module")
def vit():
    torch.manual_seed(0)
    return _timm_vit()


@pytest.mark.parametrize("name", NAMES)
def test_every_entry_declares_every_fact_on_its_class(name):
    entry = METHOD_CATALOG[name]
    assert set(FACT_NAMES) == set(FACT_TYPES)
    for fact in FACT_NAMES:
        assert hasattr(entry.method, fact), f"{entry.method.__name__} declares no {fact!r}"
        value = getattr(entry.method, fact)
        assert isinstance(value, FACT_TYPES[fact]), (name, fact, value)
        assert getattr(entry, fact) == value  # no entry overrides its class
    assert catalog_entry(name) is entry
    assert catalog_signedness(name) is entry.signed


@pytest.mark.parametrize("name", NAMES)
def test_every_class_declares_the_generation_step_kind_the_engine_calls(name):
    entry = METHOD_CATALOG[name]
    kind = entry.method.generation_steps
    assert kind in GenerationSteps
    if kind is GenerationSteps.TRACE:
        assert issubclass(entry.method, TraceAttribution)
    elif kind is GenerationSteps.RELEVANCE:
        assert issubclass(entry.method, RuleGradientXInput)
    else:
        assert not entry.needs_adapter


def test_the_name_sets_are_the_facts_and_unchanged():
    assert ON_REQUEST == {"attention-flow"}
    assert CAPTUM_BASELINES == {"integrated-gradients", "saliency"}
    assert CLASS_AGNOSTIC == {"raw-attention", "rollout", "attention-flow"}
    assert SIGNED_METHODS == {"lrp", "attn-lrp", "gradient-x-input", "conservative-lrp-ah", "conservative-lrp",
                              "integrated-gradients"}
    assert METHOD_NAMES == ("raw-attention", "rollout", "grad-cam", "partial-lrp", "lrp", "attn-lrp",
                            "gradient-x-input", "conservative-lrp-ah", "conservative-lrp", "generic-attention",
                            "transformer-relevance", "integrated-gradients", "saliency")
    assert METHOD_FACTORIES["conservative-lrp-ah"].keywords == {"variant": "AH"}
    assert METHOD_FACTORIES["generic-attention"] is METHOD_CATALOG["generic-attention"].method


def test_generation_reads_the_facts_of_the_instance_class(vit):
    explainers = {name: METHOD_FACTORIES[name](vit) for name in NAMES}
    for name, explainer in explainers.items():
        assert generation_steps(explainer) is METHOD_CATALOG[name].generation_steps
        assert signed_method(explainer) is METHOD_CATALOG[name].signed
    assert {name for name, e in explainers.items() if carries_into_tower(e)} == {
        "generic-attention", "transformer-relevance", "rollout"}
    foreign = object()  # an attribution that says nothing: prefix calls, unsigned
    assert generation_steps(foreign) is GenerationSteps.PREFIX_CALLS and not signed_method(foreign)


@pytest.fixture(scope="module")
def maps(vit):
    images = _images()
    return {name: {int(t): METHOD_FACTORIES[name](vit).attribute(images, target=torch.full((3,), int(t)))
                   for t in TARGETS[:2]} for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_signed_agrees_with_the_maps(name, maps):
    values = torch.cat([m.flatten() for m in maps[name].values()])
    if METHOD_CATALOG[name].signed:
        assert bool((values < 0).any()) and bool((values > 0).any()), name
    else:
        assert bool((values >= 0).all()), (name, float(values.min()))


@pytest.mark.parametrize("name", NAMES)
def test_class_specific_agrees_with_the_maps(name, maps):
    first, second = maps[name][0], maps[name][1]
    if METHOD_CATALOG[name].class_specific:
        assert not torch.equal(first, second), name
    else:
        assert torch.equal(first, second), name
