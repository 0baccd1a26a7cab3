"""Grad-CAM's rectified map can be 0 everywhere (every token's gradient-weighted heads sum to
<= 0): on the shipped recall Llama, for every ``<eos>`` it ends an answer with and some answer words. Such a
map is the method's answer, but a blank map reads as "nothing mattered", so it comes with a
warning; a map with any positive entry comes without."""
from __future__ import annotations

import warnings

import pytest
import torch

from captum_transformers import AttentionGradCAM, GenerationAttribution
from captum_transformers.methods.grad_cam import BLANK_MAP_WARNING, _warn_if_blank
from captum_transformers.tasks.recall.model import load_recall_model
from captum_transformers.tasks.recall.task import recall_examples


def _blank_warnings(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    return result, [w for w in caught if str(w.message) == BLANK_MAP_WARNING]


@pytest.mark.parametrize("scores, blank", [
    (torch.tensor([[0.0, 0.2], [0.0, 0.0]]), True),
    (torch.tensor([[0.0, 0.2], [0.1, 0.0]]), False),
    ({"text": torch.tensor([[0.0, 0.0]]), "image": torch.tensor([[0.0, 0.3]])}, False),  # evidence in one stream: no
    # whole-map warning (the blank stream gets its own, naming it: tests/test_trust3_zoo.py)
    ({"text": torch.zeros(2, 3), "image": torch.tensor([[0.0, 0.3], [0.0, 0.0]])}, True),
    ((torch.zeros(1, 4),), True),
])
def test_a_map_zero_everywhere_in_some_example_warns(scores, blank):
    returned, caught = _blank_warnings(lambda: _warn_if_blank(scores))
    assert returned is scores
    assert bool(caught) == blank


def test_the_recall_models_blank_steps_warn_and_its_first_step_does_not():
    model, tokenizer = load_recall_model()
    explainer = GenerationAttribution(AttentionGradCAM(model), tokenizer)
    prompt = recall_examples(1, seed=1)[0].prompt
    result, caught = _blank_warnings(lambda: explainer.attribute(prompt))
    rows = result.token_attr.abs().amax(dim=1)
    assert result.output_tokens == ["deer", "ant", "<eos>"]
    assert rows[0] > 0 and (rows[1:] == 0).all() and caught
    first, caught = _blank_warnings(lambda: explainer.attribute(prompt, target="deer"))
    assert first.token_attr.abs().max() > 0 and not caught
