"""Models that mix tokens without softmax attention (issue 42, items 2 and 5: refused by name, no raw exceptions).

FNet (Fourier mixing) and Mamba (a state-space scan) have no attention module: every method of
the package that needs one is refused by a ``CaptureError`` that says why (the relevance methods
raised a raw ``IndexError`` before), and Captum's baselines, which need none, explain them. A
causal LM's (B, N, V) scores need a ``(position, token)`` target: an int is the package's
``InputError`` naming the shape, not Captum's ``AssertionError``.
"""
from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from captum_transformers import CaptureError, InputError  # noqa: E402
from captum_transformers.methods.catalog import KNOWN_METHOD_NAMES, build_method  # noqa: E402

IDS = torch.tensor([[2, 5, 7, 9, 11, 3]])
CAPTUM = ("integrated-gradients", "saliency")


def _fnet():
    torch.manual_seed(0)
    return transformers.FNetForSequenceClassification(transformers.FNetConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_labels=3)).eval()


def _mamba():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.MambaForCausalLM(transformers.MambaConfig(
            vocab_size=50, hidden_size=32, num_hidden_layers=2, state_size=4)).eval()


MODELS = {"fnet": (_fnet, 1), "mamba": (_mamba, (5, 7))}


@pytest.mark.parametrize("family", sorted(MODELS))
@pytest.mark.parametrize("name", KNOWN_METHOD_NAMES)
def test_every_method_explains_or_refuses_by_name(family, name):
    build, target = MODELS[family]
    model = build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    method = build_method(name, model)
    if name in CAPTUM:
        scores = method.attribute(IDS, target=target)
        assert scores.shape == IDS.shape and torch.isfinite(scores).all() and scores.abs().sum() > 0
    else:
        with pytest.raises(CaptureError, match="no attention"):
            method.attribute(IDS, target=target)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name", CAPTUM)
def test_a_class_target_on_per_position_scores_names_the_shape(name):
    with pytest.raises(InputError, match=r"2 non-batch dimension\(s\) of sizes \(6, 50\)"):
        build_method(name, _mamba()).attribute(IDS, target=1)


@pytest.mark.parametrize("name", [n for n in KNOWN_METHOD_NAMES if n not in CAPTUM])
def test_differential_attention_is_refused_by_name(name):
    """DiffLlama's heads weigh values by A1 - lambda A2: no probability map to read (issue 42)."""
    from captum_transformers import UnsupportedModelError

    torch.manual_seed(0)
    model = transformers.DiffLlamaForCausalLM(transformers.DiffLlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)).eval()
    with pytest.raises(UnsupportedModelError, match="differential attention"):
        build_method(name, model).attribute(IDS, target=(5, 7))
