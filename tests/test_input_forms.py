"""Input and output forms beyond Captum's tensors: mapping outputs ({"logits": ...}), mapping
inputs (a tokenizer's BatchEncoding, forward(**batch) wrappers, inputs_embeds) and boolean
targets. Each accepted form gives exactly the attribution of the plain call; each refused
form is an InputError that says how to pass it."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from captum_transformers import (AttnLRP, ConservativeLRP, GenericAttention, InputError, TransformerRelevance)
from hf_models import CASES
from lrp_models import EncoderClassifier
from restore import assert_same, snapshot

transformers = pytest.importorskip("transformers")

METHODS = [GenericAttention, TransformerRelevance, ConservativeLRP, AttnLRP]


class DictOutput(nn.Module):
    """A wrapper returning a plain dict, as many training codebases do."""

    def __init__(self, inner: nn.Module, key: str = "logits"):
        super().__init__()
        self.inner = inner
        self.key = key

    def forward(self, inputs, attention_mask=None):
        output = self.inner(inputs, attention_mask) if attention_mask is not None else self.inner(inputs)
        scores = output.logits if hasattr(output, "logits") else output
        return {self.key: scores, "hidden": scores.detach() * 0}


class KeywordsOnly(nn.Module):
    """``forward(**batch)``: the usual wrapper around ``model(**tokenizer(...))``."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, **batch):
        return self.inner(**batch).logits


@pytest.fixture(scope="module")
def bert():
    ids, kwargs = CASES["bert"].inputs()
    return CASES["bert"].model(), ids, kwargs["attention_mask"]


def _encoding(ids, mask):
    return transformers.BatchEncoding({"input_ids": ids, "attention_mask": mask})


# -- mapping outputs -------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.__name__)
def test_dict_output_explains_its_logits_on_a_hf_model(bert, method):
    model, ids, mask = bert
    expected = method(model).attribute(ids, target=1, forward_kwargs={"attention_mask": mask})
    got = method(DictOutput(model)).attribute(ids, target=1, additional_forward_args=(mask,))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("method", [GenericAttention, ConservativeLRP], ids=lambda m: m.__name__)
def test_dict_output_explains_its_logits_on_a_torch_encoder(method):
    torch.manual_seed(0)
    model = EncoderClassifier().eval()
    ids = torch.randint(0, 23, (2, 6))
    expected = method(model).attribute(ids, target=2)
    torch.testing.assert_close(method(DictOutput(model)).attribute(ids, target=2), expected, rtol=0, atol=0)


@pytest.mark.parametrize("model", ["hf", "torch"])
def test_dict_output_without_logits_names_its_keys(bert, model):
    inner = bert[0] if model == "hf" else EncoderClassifier().eval()
    ids = bert[1] if model == "hf" else torch.randint(0, 23, (2, 6))
    with pytest.raises(InputError, match=r"'scores'.*'logits'|none of the fields"):
        GenericAttention(DictOutput(inner, key="scores")).attribute(ids, target=0)


# -- mapping inputs --------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.__name__)
def test_batch_encoding_gives_the_attribution_of_its_input_ids(bert, method):
    model, ids, mask = bert
    before = snapshot(model)
    expected = method(model).attribute(ids, target=[0, 1, 2], forward_kwargs={"attention_mask": mask})
    got = method(model).attribute(_encoding(ids, mask), target=[0, 1, 2])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert_same(before, snapshot(model))


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.__name__)
def test_forward_with_keywords_only_takes_a_batch_encoding(bert, method):
    model, ids, mask = bert
    expected = method(model).attribute(ids, target=2, forward_kwargs={"attention_mask": mask})
    wrapper = KeywordsOnly(model)
    torch.testing.assert_close(method(wrapper).attribute(_encoding(ids, mask), target=2), expected, rtol=0, atol=0)
    # The hook that passes input_ids by name is gone afterwards.
    assert not wrapper._forward_pre_hooks


def test_forward_with_keywords_only_and_a_tensor_says_to_pass_a_mapping(bert):
    model, ids, _ = bert
    with pytest.raises(InputError, match="keyword arguments only.*mapping"):
        GenericAttention(KeywordsOnly(model)).attribute(ids, target=0)


def test_inputs_embeds_by_name_explain_the_same_tokens(bert):
    model, ids, mask = bert
    embeddings = model.bert.embeddings.word_embeddings(ids).detach()
    tokens = GenericAttention(model).attribute(ids, target=0, forward_kwargs={"attention_mask": mask})
    mapped = GenericAttention(model).attribute({"inputs_embeds": embeddings, "attention_mask": mask}, target=0)
    assert mapped.shape == embeddings.shape
    torch.testing.assert_close(mapped[..., 0], tokens)
    assert bool((mapped == mapped[..., :1]).all())


def test_pixel_values_mapping_on_an_image_model():
    model = CASES["vit"].model()
    pixels, _ = CASES["vit"].inputs()
    expected = GenericAttention(model).attribute(pixels, target=3)
    torch.testing.assert_close(GenericAttention(model).attribute({"pixel_values": pixels}, target=3), expected,
                               rtol=0, atol=0)


@pytest.mark.parametrize("inputs, extra, match", [
    ({"ids": torch.zeros(3, 7, dtype=torch.long)}, {}, "none of.*input_ids"),
    ({"input_ids": torch.zeros(3, 7, dtype=torch.long), "pixel_values": torch.zeros(3, 3, 8, 8)}, {},
     "several tensors.*tuple"),
    ({"input_ids": [[5, 6, 7]] * 3}, {}, "return_tensors='pt'"),
    ({"input_ids": torch.zeros(3, 7, dtype=torch.long)}, {"additional_forward_args": (torch.ones(3, 7),)},
     "by name"),
    ({"input_ids": torch.zeros(3, 7, dtype=torch.long), "attention_mask": torch.ones(3, 7)},
     {"forward_kwargs": {"attention_mask": torch.ones(3, 7)}}, "once"),
])
def test_mapping_inputs_that_cannot_be_split_say_how_to_pass_them(bert, inputs, extra, match):
    with pytest.raises(InputError, match=match):
        GenericAttention(bert[0]).attribute(inputs, target=0, **extra)


# -- boolean targets -------------------------------------------------------------------------
@pytest.mark.parametrize("target", [
    True, False, np.True_, torch.tensor(True), torch.tensor([True, False, True]), np.array([True, False, True]),
    [True, 0, 1], [(True,), (0,), (1,)], (True,),
], ids=lambda t: f"{type(t).__name__}:{t!r}"[:40])
@pytest.mark.parametrize("method", [GenericAttention, AttnLRP], ids=lambda m: m.__name__)
def test_boolean_targets_are_refused(bert, method, target):
    model, ids, mask = bert
    with pytest.raises(InputError, match="boolean.*class index"):
        method(model).attribute(ids, target=target, forward_kwargs={"attention_mask": mask})


def test_keyword_only_check_reads_a_function_bound_and_unbound_apart():
    """The signature is remembered per function; the same function bound as a method (its
    first parameter dropped) and stored on an instance (taken as a positional parameter) are
    answered apart."""
    from captum_transformers.capture.inputs import _takes_positional

    def forward(self, *, input_ids=None):
        return input_ids

    class KeywordOnly(torch.nn.Module):
        pass

    KeywordOnly.forward = forward
    module = KeywordOnly()
    assert _takes_positional(module.forward) is False          # bound: only keywords remain
    assert _takes_positional(module.forward) is False          # remembered
    assert _takes_positional(forward) is True                  # as is: ``self`` is positional
    assert _takes_positional(module.forward) is False
