"""Every relevance method on every HF family of the foundation: shapes, batch == single,
restore, and the conservation the rule set promises where the model allows it."""
from __future__ import annotations

import pytest
import torch

from captum_transformers import LRP_ATTENTION_METHODS, RELEVANCE_METHODS, get_adapter
from hf_models import CASES
from restore import assert_same, snapshot

METHODS = [pytest.param(m, id=m.__name__) for m in (*RELEVANCE_METHODS, *LRP_ATTENTION_METHODS)]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("method", METHODS)
def test_relevance_method_on_family(case, method):
    spec = CASES[case]
    model = spec.model("eager")
    inputs, kwargs = spec.inputs(batch=2)
    before = snapshot(model)
    explainer = method(model)
    maps = explainer.attribute(inputs, target=[1, 2], forward_kwargs=kwargs)
    assert maps.shape == inputs.shape and torch.isfinite(maps).all()
    tokens = explainer.attribute(inputs, target=[1, 2], forward_kwargs=kwargs, return_tokens=True)
    assert tokens.shape[0] == 2 and torch.isfinite(tokens).all() and tokens.abs().sum() > 0
    for i in range(2):
        single = explainer.attribute(inputs[i:i + 1], target=[1, 2][i], return_tokens=True,
                                     forward_kwargs={k: v[i:i + 1] for k, v in kwargs.items()})
        torch.testing.assert_close(tokens[i:i + 1], single, rtol=1e-4, atol=1e-6)
    assert_same(before, snapshot(model))
    assert get_adapter(model).name == "huggingface"
