"""Tiny workspaces for the explorer and Insights-bridge tests: a timm ViT on random images and a
torch TransformerEncoder on token ids, with class names and tokens carrying an HTML payload."""
from __future__ import annotations

import torch

from captum_transformers.explorer.pages.classifier.workspace import Workspace
from captum_transformers.methods.catalog import METHOD_FACTORIES
from tiny_models import EncoderClassifier, timm_vit_case

PAYLOAD = '<img src=x onerror="window.__pwned=1">'


class CountingBuilder:
    """A method builder that records every attribute call and the batch size it received."""

    def __init__(self):
        self.calls = []

    def __call__(self, name, model, arguments):
        explainer = METHOD_FACTORIES[name](model, **arguments)
        original = explainer.attribute
        calls = self.calls

        def attribute(inputs, *args, **kwargs):
            first = inputs[0] if isinstance(inputs, tuple) else inputs
            calls.append((name, dict(arguments), first.shape[0]))
            return original(inputs, *args, **kwargs)

        explainer.attribute = attribute
        return explainer


def image_workspace(builder=None, batch: int = 4) -> Workspace:
    model, _, _ = timm_vit_case()
    generator = torch.Generator().manual_seed(3)
    images01 = torch.rand(batch, 3, 32, 32, generator=generator)
    names = ["zero", PAYLOAD, "two", "three", "four"]
    labels = torch.tensor([i % 5 for i in range(batch)])
    kwargs = {"method_builder": builder} if builder is not None else {}
    return Workspace(model, ((images01 - 0.5) / 0.25,), list(images01), "image", labels=labels, class_names=names,
                     name="tiny timm ViT", **kwargs)


def text_workspace(builder=None) -> Workspace:
    model = EncoderClassifier().eval()
    tokens = [["[CLS]", "good", PAYLOAD, "film"], ["[CLS]", "dull", "plot", "<b>bold</b>"]]
    ids = torch.tensor([[1, 5, 7, 9], [1, 4, 6, 8]])
    kwargs = {"method_builder": builder} if builder is not None else {}
    return Workspace(model, (ids,), tokens, "text", labels=torch.tensor([0, 1]), class_names=["neg", PAYLOAD, "pos"],
                     name="tiny encoder", special_tokens=frozenset({"[CLS]"}), removed_token_id=0, **kwargs)
