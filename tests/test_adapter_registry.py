"""Every registered adapter x every attention method, from one small example per adapter.

A new adapter must add its example here (the first test fails until it does), and then
gets the whole contract checked for free: lookup, shapes, batch == single, and exact
restore after an exception raised mid-forward.
"""
from __future__ import annotations

import pytest
import torch

from captum_transformers import ATTENTION_METHODS, InputError, get_adapter, registered_adapters
from captum_transformers.adapters.vision_language.base import VisionLanguageAdapter
from tiny_models import EncoderClassifier
from restore import assert_same, raising_after, snapshot


def _huggingface():
    from hf_models import CASES

    spec = CASES["bert"]
    inputs, kwargs = spec.inputs()
    return spec.model(), inputs, kwargs


def _timm():
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
    return model.eval(), torch.randn(3, 3, 32, 32), {}




def _torch_mha():
    ids = torch.randint(0, 20, (3, 6))
    padding = torch.zeros(3, 6, dtype=torch.bool)
    padding[1, 4:] = True
    return EncoderClassifier().eval(), ids, {"key_padding_mask": padding}


def _inline_attention():
    import transformers

    torch.manual_seed(0)
    model = transformers.VisualBertForVisualReasoning(transformers.VisualBertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, visual_embedding_dim=8,
        vocab_size=50, num_labels=3))
    ids = torch.randint(3, 50, (3, 6))
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, 4:] = 0
    return model.eval(), ids, {"attention_mask": mask, "visual_embeds": torch.randn(3, 4, 8)}


def _swin():
    from swin_models import hf_swin

    return hf_swin(), torch.randn(3, 3, 36, 44), {}


def _swinv2():
    from swin_models import hf_swin

    return hf_swin(version=2), torch.randn(3, 3, 36, 44), {}


def _timm_swin():
    from swin_models import timm_swin

    return timm_swin(image=(36, 44), fused=True), torch.randn(3, 3, 36, 44), {}


def _detr():
    from detr_models import detr, images

    return detr(), images(3), {}


def _pyg_attention():
    from pyg_models import graph_classifier

    return graph_classifier("TransformerConv"), None, {}


def _pyg_gps():
    from pyg_models import gps_classifier

    return gps_classifier(), None, {}


def _graphormer():
    from graphormer_models import batch, graphs, model

    nodes, rest = batch(graphs((5, 3, 7)))
    return model(), nodes, rest


def _llava():
    from vlm_models import build_llava, image_prompt, pixels

    ids = torch.tensor([image_prompt([1, 5 + i], [7, 9]) for i in range(3)])
    return build_llava(), ids, {"pixel_values": pixels(3)}


def _gemma3_vl():
    from vlm_family_models import build_gemma3, gemma_pixels, gemma_prompt
    ids = torch.tensor([gemma_prompt([1, 5 + i], [7, 9]) for i in range(3)])
    return build_gemma3(), ids, {"pixel_values": gemma_pixels(3)}


EXAMPLES = {"huggingface": _huggingface, "timm": _timm, "torch_mha": _torch_mha, "inline_attention": _inline_attention,
            "detr": _detr, "graphormer": _graphormer, "swin": _swin, "swinv2": _swinv2,
            "timm_swin": _timm_swin, "llava": _llava, "gemma3-vl": _gemma3_vl}
# Graph batches are not sliced along dimension 0 of the node features: their contract (lookup,
# shapes, batch == graphs one at a time, restore) is checked in tests/test_pyg_attention.py
# and tests/test_pyg_gps.py.
GRAPH_EXAMPLES = {"pyg_attention": _pyg_attention, "pyg_gps": _pyg_gps}
# Qwen2-VL's pixel_values are the patches of every image of the batch in one (patches, C*T*P*P)
# tensor, not sliced along dimension 0 per example: its contract (lookup, batch == single calls,
# restore after an exception) is checked through GenerationAttribution in tests/test_vlm_qwen2.py.
FLAT_PATCH_EXAMPLES = {"qwen2-vl"}
# Targets per example when the output is not (B, classes): DETR's are (query, class) pairs.
TARGETS = {"detr": [(0, 1), (4, 2), (2, 0)]}
ADAPTERS = sorted(a.name for a in registered_adapters())
METHODS = [pytest.param(m, id=m.__name__) for m in ATTENTION_METHODS]


def test_every_registered_adapter_has_an_example():
    examples = set(EXAMPLES) | set(GRAPH_EXAMPLES) | FLAT_PATCH_EXAMPLES
    assert set(ADAPTERS) <= examples, f"add an example for {set(ADAPTERS) - examples}"


@pytest.mark.parametrize("name", sorted(GRAPH_EXAMPLES))
def test_graph_examples_find_their_adapter(name):
    pytest.importorskip("torch_geometric")
    model, _, _ = GRAPH_EXAMPLES[name]()
    assert get_adapter(model).name == name


@pytest.mark.parametrize("name", [name for name in ADAPTERS if name not in GRAPH_EXAMPLES
                                  and name not in FLAT_PATCH_EXAMPLES])
@pytest.mark.parametrize("method", METHODS)
def test_adapter_contract(name, method):
    model, inputs, kwargs = EXAMPLES[name]()
    assert get_adapter(model).name == name
    explainer = method(model)
    targets = TARGETS.get(name, [0, 1, 2])
    maps = explainer.attribute(inputs, target=targets, forward_kwargs=kwargs)
    assert maps.shape == inputs.shape and torch.isfinite(maps).all()
    # A vision-language model's tower tokens are not scored by a direct call: return_tokens is refused.
    return_tokens = not isinstance(get_adapter(model), VisionLanguageAdapter)
    if not return_tokens:
        with pytest.raises(InputError, match="GenerationAttribution"):
            explainer.attribute(inputs, target=targets, forward_kwargs=kwargs, return_tokens=True)
    tokens = explainer.attribute(inputs, target=targets, forward_kwargs=kwargs, return_tokens=return_tokens)
    per_stream = (lambda scores: scores if isinstance(scores, tuple) else (scores,))
    for i in range(inputs.shape[0]):
        single = explainer.attribute(inputs[i:i + 1], target=targets[i], return_tokens=return_tokens,
                                     forward_kwargs={k: v[i:i + 1] for k, v in kwargs.items()})
        assert len(per_stream(tokens)) == len(per_stream(single))
        for together, alone in zip(per_stream(tokens), per_stream(single)):
            torch.testing.assert_close(together[i:i + 1], alone, rtol=1e-4, atol=1e-6)

    with torch.no_grad():
        before_output = model(inputs, **kwargs)
    before = snapshot(model)
    # KeyboardInterrupt is not an Exception: restore must not depend on `except Exception`.
    with raising_after(get_adapter(model).blocks(model)[-1].module, KeyboardInterrupt()):
        with pytest.raises(KeyboardInterrupt):
            explainer.attribute(inputs, target=targets, forward_kwargs=kwargs)
    assert_same(before, snapshot(model))
    with torch.no_grad():
        after_output = model(inputs, **kwargs)
    first = (lambda out: out if isinstance(out, torch.Tensor) else out[0])
    assert torch.equal(first(before_output), first(after_output))
