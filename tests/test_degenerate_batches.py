"""Batches with nothing to explain: an example whose mask hides every token, and B = 0.

Both are refused with an :class:`InputError` on every adapter and every method family (an
all-masked example gave a NaN map on nn.MultiheadAttention models and an IndexError on
GPT-2; an empty batch a bare reshape error). An empty batch is refused rather than answered
with an empty result: without a forward pass the token count of ``return_tokens=True`` is
unknown.
"""
from __future__ import annotations

import pytest
import torch

from captum_transformers import ATTENTION_METHODS, LRP_ATTENTION_METHODS, RELEVANCE_METHODS, InputError
from hf_models import CASES
from test_adapter_registry import EXAMPLES, TARGETS

ALL_METHODS = [pytest.param(m, id=m.__name__) for m in ATTENTION_METHODS + LRP_ATTENTION_METHODS + RELEVANCE_METHODS]
# Adapters whose example carries a padding mask, and how that mask hides every token of one example.
MASKED = {
    "huggingface": ("attention_mask", 0),
    "torch_mha": ("key_padding_mask", True),
    "inline_attention": ("attention_mask", 0),
    "detr": ("pixel_mask", 0),
}


def _explain(method, model, inputs, kwargs, targets):
    return method(model).attribute(inputs, target=targets, forward_kwargs=kwargs, return_tokens=True)


@pytest.mark.parametrize("name", sorted(MASKED))
@pytest.mark.parametrize("method", ALL_METHODS)
def test_all_masked_example_is_refused_by_index(name, method):
    model, inputs, kwargs = EXAMPLES[name]()
    key, hidden = MASKED[name]
    mask = kwargs[key].clone() if key in kwargs else torch.ones(3, *inputs.shape[2:], dtype=torch.long)
    mask[2] = hidden
    if name == "inline_attention":  # VisualBERT's visual tokens are real unless masked too
        visual = torch.ones(3, kwargs["visual_embeds"].shape[1], dtype=torch.long)
        visual[2] = 0
        kwargs = {**kwargs, "visual_attention_mask": visual}
    with pytest.raises(InputError, match=r"Example\(s\) \[2\] of the batch have an attention mask that masks every"):
        _explain(method, model, inputs, {**kwargs, key: mask}, TARGETS.get(name, [0, 1, 2]))


@pytest.mark.parametrize("case", ["gpt2", "llama_gqa", "bert"])
@pytest.mark.parametrize("method", ALL_METHODS)
def test_all_masked_examples_of_hf_decoders_are_refused(case, method):
    spec = CASES[case]
    model = spec.model()
    ids, kwargs = spec.inputs(batch=4)
    kwargs["attention_mask"][0] = 0
    kwargs["attention_mask"][3] = 0
    with pytest.raises(InputError, match=r"Example\(s\) \[0, 3\]"):
        method(model).attribute(ids, target=1, forward_kwargs=kwargs, return_tokens=True)


@pytest.mark.parametrize("method", [pytest.param(m, id=m.__name__) for m in ATTENTION_METHODS + LRP_ATTENTION_METHODS])
def test_masked_explained_token_is_refused(method):
    """A left-padded encoder batch puts padding where BERT reads its CLS token: every map of
    that example would be zeroed (the padded row), so it is refused. Relevance methods do not
    read rows: they explain the same score and stay allowed."""
    spec = CASES["bert"]
    model = spec.model()
    ids, kwargs = spec.inputs()
    kwargs["attention_mask"][1] = torch.tensor([0, 0, 1, 1, 1, 1, 1])
    with pytest.raises(InputError, match=r"Example\(s\) \[1\] of the batch would be explained at the 'tokens' token "
                                         r"position\(s\) \[\[0\]\], which their attention mask marks as padding"):
        method(model).attribute(ids, target=1, forward_kwargs=kwargs, return_tokens=True)
    for relevance_method in RELEVANCE_METHODS:
        scores = relevance_method(model).attribute(ids, target=1, forward_kwargs=kwargs, return_tokens=True)
        assert torch.isfinite(scores).all() and (scores[1, 2:] != 0).any() and (scores[1, :2] == 0).all()


@pytest.mark.parametrize("name", sorted(EXAMPLES))
@pytest.mark.parametrize("method", ALL_METHODS)
def test_empty_batch_is_refused(name, method):
    model, inputs, kwargs = EXAMPLES[name]()
    empty = {key: value[:0] if isinstance(value, torch.Tensor) else value for key, value in kwargs.items()}
    explainer = method(model)
    for return_tokens in (False, True):
        with pytest.raises(InputError, match="The batch is empty"):
            explainer.attribute(inputs[:0], target=0, forward_kwargs=empty, return_tokens=return_tokens)
