"""Models with gradient checkpointing in train mode (``model.gradient_checkpointing_enable();
model.train()``).

A checkpointed layer re-runs its forward in the backward pass, outside the capture, so every
method raised torch's CheckpointError. Inside the capture the layers run plainly (the flags
turned off through ``patching.attributes``); the explanation equals the one of the same model
without checkpointing (same dropout draws), and every flag is back afterwards, so training
with checkpointing goes on as before.
"""
from __future__ import annotations

import pytest
import torch

from captum_transformers import ATTENTION_METHODS, LRP_ATTENTION_METHODS, RELEVANCE_METHODS
from hf_models import CASES
from lrp_models import BertClassifier
from restore import assert_same, snapshot

ALL_METHODS = [pytest.param(m, id=m.__name__) for m in ATTENTION_METHODS + LRP_ATTENTION_METHODS + RELEVANCE_METHODS]


def _bert_inside_a_wrapper():
    torch.manual_seed(0)
    ids, kwargs = CASES["bert"].inputs()
    return BertClassifier(attn_implementation="eager"), ids, kwargs, lambda model: model.bert


def _case(name):
    if name == "wrapped_bert":
        return _bert_inside_a_wrapper()
    spec = CASES[name]
    inputs, kwargs = spec.inputs()
    return spec.model(), inputs, kwargs, lambda model: model


MODELS = ["bert", "gpt2", "llama_gqa", "vit", "wrapped_bert"]


def _flags(model):
    return {name: module.gradient_checkpointing for name, module in model.named_modules()
            if hasattr(module, "gradient_checkpointing")}


def _explain(method, model, inputs, kwargs):
    torch.manual_seed(7)  # the same dropout draws in both runs
    # Dropout is active in train mode (p = 0.1): explained on purpose, one seeded draw per run.
    return method(model, allow_stochastic=True).attribute(inputs, target=1, forward_kwargs=kwargs, return_tokens=True)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("method", ALL_METHODS)
def test_checkpointed_model_in_train_mode_is_explained_and_restored(name, method):
    model, inputs, kwargs, pretrained = _case(name)
    model.train()
    reference = _explain(method, model, inputs, kwargs)

    pretrained(model).gradient_checkpointing_enable()
    flags = _flags(model)
    assert any(flags.values()), "precondition: checkpointing is on"
    before = snapshot(model)
    scores = _explain(method, model, inputs, kwargs)
    torch.testing.assert_close(scores, reference, rtol=1e-5, atol=1e-6)
    assert _flags(model) == flags and model.training
    assert_same(before, snapshot(model))

    # Training with checkpointing still works: the backward pass re-runs the checkpointed layers.
    output = model(inputs, **kwargs)
    logits = output if isinstance(output, torch.Tensor) else output.logits
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad and p.grad is not None)
