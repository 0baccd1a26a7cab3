"""Models that mix tokens without softmax attention (issue 42, items 2 and 5: refused by name, no raw exceptions).

FNet (Fourier mixing) and Mamba (a state-space scan) have no attention module: every method of
the package defined on attention maps is refused by a ``NotSoftmaxAttentionError`` (a
``CaptureError``) naming the family's token mixing (the relevance methods raised a raw
``IndexError`` before), and Captum's baselines, which need none, explain them; a token target on
Mamba's (B, N, V) scores is the next-token logit at the last real token, as for any causal LM.
"""
from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from captum_transformers import CaptureError, NotSoftmaxAttentionError  # noqa: E402
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
    if name in CAPTUM:
        scores = build_method(name, model).attribute(IDS, target=target)
        assert scores.shape == IDS.shape and torch.isfinite(scores).all() and scores.abs().sum() > 0
    else:
        with pytest.raises(NotSoftmaxAttentionError, match="not by softmax attention over the sequence") as error:
            build_method(name, model).attribute(IDS, target=target)
        assert isinstance(error.value, CaptureError)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name", CAPTUM)
def test_a_token_target_on_a_recurrent_lm_is_its_last_tokens_next_token_logit(name):
    model = _mamba()
    torch.testing.assert_close(build_method(name, model).attribute(IDS, target=1),
                               build_method(name, model).attribute(IDS, target=(5, 1)), rtol=0, atol=0)


@pytest.mark.parametrize("name", [n for n in KNOWN_METHOD_NAMES if n not in CAPTUM])
def test_differential_attention_is_refused_by_name(name):
    """DiffLlama's heads weigh values by A1 - lambda A2: no probability map to read (issue 42)."""
    torch.manual_seed(0)
    model = transformers.DiffLlamaForCausalLM(transformers.DiffLlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)).eval()
    with pytest.raises(NotSoftmaxAttentionError, match="differential attention"):
        build_method(name, model).attribute(IDS, target=(5, 7))
