"""Nothing an explanation creates outlives its ``attribute`` call, in an evaluation loop too.

An autograd Function's context is a C++ object: a Python reference from it (or from a hook
registered on a graph tensor) back to something that keeps the graph alive closes a cycle no
garbage collector can see, so every call's graph stayed alive for good (GenericAttention,
AttentionGradCAM, PartialLRP and TransformerRelevance: 6-22 tensors per call on every adapter,
about 28 MiB per call on a ViT-Ti-sized model at batch 8). The counts below are of live
tensors in ``gc.get_objects()``: 20 calls under ``gc.disable()`` (what reference counting
alone frees: no cycles at all) must leave exactly as many as before, and so must the same
after a collection. Every method of the catalog x every registered adapter's example; Qwen2-VL
through GenerationAttribution (its flat patch rows are not one row per example), and Captum's
Saliency, which needs (B, classes) logits, not on the vision-language models.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from captum_transformers.adapters.graph.pyg_gps import PyGGPSAdapter
from captum_transformers.errors import CaptureError, InputError, UnsupportedModelError
from captum_transformers.methods.catalog import CAPTUM_BASELINES, METHOD_FACTORIES
from test_adapter_registry import ADAPTERS, EXAMPLES, TARGETS

CALLS = 20
# Qwen2-VL's pixel_values are every image's patch rows in one tensor, not one row per example: it
# is explained through GenerationAttribution (tests/test_vlm_qwen2.py), so its loop runs there.
GENERATION_ONLY = {"qwen2-vl"}
# Exact maximum flows cost seconds per example: one adapter suffices for its loop.
SLOW = {"attention-flow": {"timm"}}


def _graph_case(name):
    """(model, inputs, call keywords, adapter) of the graph examples: node features with the
    edges and batch vector as additional arguments."""
    pytest.importorskip("torch_geometric")
    from pyg_models import gps_classifier, graph_classifier, graphs

    _, (x, edge_index, batch) = graphs()
    if name == "pyg_gps":
        return gps_classifier(), x, {"additional_forward_args": (edge_index, batch)}, PyGGPSAdapter(
            ignore_local_branch=True)
    return graph_classifier("TransformerConv"), x, {"additional_forward_args": (edge_index, batch)}, None


def _qwen2_vl_case():
    """A prompt with one 4x4-patch image and two target tokens, explained by GenerationAttribution."""
    from vlm_family_models import build_qwen2_vl, qwen_pixels, qwen_prompt

    ids = torch.tensor(qwen_prompt([1, 5], (4, 4), [7, 8]))
    return build_qwen2_vl(), ids, {"target": [9, 11], **qwen_pixels([(4, 4)])}, None


def _case(name):
    if name in GENERATION_ONLY:
        return _qwen2_vl_case()
    if name in ("pyg_attention", "pyg_gps"):
        model, inputs, call, adapter = _graph_case(name)
        return model, inputs, {**call, "target": [0, 1, 1]}, adapter
    model, inputs, kwargs = EXAMPLES[name]()
    return model, inputs, {"target": TARGETS.get(name, [0, 1, 2]), "forward_kwargs": kwargs}, None


def _build(method, model, adapter, adapter_name=None):
    factory = METHOD_FACTORIES[method]
    if adapter_name in GENERATION_ONLY:
        from captum_transformers.generation import GenerationAttribution
        from generation_models import IdTokenizer
        return GenerationAttribution(factory(model), IdTokenizer())
    # Captum's own baselines read no attention: they take no adapter.
    return factory(model) if adapter is None or method in CAPTUM_BASELINES else factory(model, adapter=adapter)


def _live_tensors() -> int:
    return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))


def _explains(explainer, inputs, call) -> bool:
    """Whether the method explains this model (a clear refusal is a fine answer here)."""
    try:
        explainer.attribute(inputs, **call)
    except (CaptureError, InputError, UnsupportedModelError):
        return False
    return True


# Captum's Integrated Gradients expands every additional argument along the batch, a graph's
# edge_index included (which torch_geometric then rejects): not a graph method.
# Captum's Saliency needs a (B, classes) output; a generative vision-language model returns
# (B, T, vocabulary) logits, which the package's methods (and GenerationAttribution) explain.
# GenerationAttribution takes the package's methods only.
VISION_LANGUAGE = {"llava", "gemma3-vl", "qwen2-vl"}
NOT_FOR = {"integrated-gradients": {"pyg_attention", "pyg_gps"} | GENERATION_ONLY, "saliency": VISION_LANGUAGE}
CASES = [pytest.param(adapter, method, id=f"{adapter}-{method}")
         for adapter in ADAPTERS for method in METHOD_FACTORIES
         if (method not in SLOW or adapter in SLOW[method]) and adapter not in NOT_FOR.get(method, ())]


@pytest.mark.parametrize("adapter_name,method", CASES)
def test_repeated_calls_leave_no_tensor_alive(adapter_name, method):
    model, inputs, call, adapter = _case(adapter_name)
    explainer = _build(method, model, adapter, adapter_name)
    if not _explains(explainer, inputs, call):
        pytest.skip(f"{method} refuses the {adapter_name} example")
    explainer.attribute(inputs, **call)  # caches filled once per process are not per call
    gc.collect()
    before = _live_tensors()
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(CALLS):
            maps = explainer.attribute(inputs, **call)
        del maps
        without_collection = _live_tensors()
    finally:
        if enabled:
            gc.enable()
    gc.collect()
    after = _live_tensors()
    assert without_collection == before, (
        f"{without_collection - before} tensors left in reference cycles after {CALLS} calls of {method} on "
        f"{adapter_name} (gc disabled)")
    assert after == before, f"{after - before} tensors kept alive after {CALLS} calls of {method} on {adapter_name}"


@pytest.mark.parametrize("adapter_name", ADAPTERS)
def test_the_model_and_inputs_are_not_kept_alive(adapter_name):
    model, inputs, call, adapter = _case(adapter_name)
    weak_model, weak_inputs = weakref.ref(model), weakref.ref(inputs)
    for method in ("generic-attention", "transformer-relevance", "attn-lrp"):
        explainer = _build(method, model, adapter, adapter_name)
        assert _explains(explainer, inputs, call) or adapter_name not in VISION_LANGUAGE, f"{method} refused"
        del explainer
    del model, inputs, call, adapter
    gc.collect()
    assert weak_model() is None, "the package keeps the explained model alive after attribute returned"
    assert weak_inputs() is None, "the package keeps the inputs alive after attribute returned"
