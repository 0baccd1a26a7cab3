"""Sliding-window attention is part of the attention pattern, never padding.

Mistral and Qwen2 with ``sliding_window``, Gemma 2 / 3 with ``layer_types`` mixing sliding and
full attention. With a window of 3 keys and 3 layers, the last token's own window holds 3
tokens, but the layers below reach further: every method that follows all layers must give
those tokens relevance, exactly the tokens the model's own attention reaches. Padding comes
from the attention mask alone, and the captured maps are the model's eager maps (the window
still applies in the scores).
"""
from __future__ import annotations

import pytest
import torch

from captum_transformers import (ATTENTION_METHODS, LRP_ATTENTION_METHODS, RELEVANCE_METHODS, AttentionGradCAM,
                                 AttentionRollout, PartialLRP, RawAttention)
from captum_transformers.capture.trace import CaptureSpec
from captum_transformers.engine.runner import run_trace

transformers = pytest.importorskip("transformers")

WINDOW, LENGTH = 3, 8
_COMMON = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
               vocab_size=99, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0,
               sliding_window=WINDOW, attn_implementation="eager")
_MIXED = ["sliding_attention", "full_attention", "sliding_attention"]
BUILDERS = {
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**_COMMON)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **_COMMON, use_sliding_window=True, max_window_layers=0)),
    "gemma2": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**_COMMON, head_dim=8,
                                                                               layer_types=_MIXED)),
    "gemma3": lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**_COMMON, head_dim=8,
                                                                                   layer_types=_MIXED)),
}
MODELS = sorted(BUILDERS)
METHODS = [pytest.param(m, id=m.__name__) for m in ATTENTION_METHODS + LRP_ATTENTION_METHODS + RELEVANCE_METHODS]
# Methods that read the last attention map only: they reach the last token's window alone.
LAST_MAP_METHODS = (RawAttention, AttentionGradCAM, PartialLRP)
# Methods with no positive part: every token the model reaches gets a non-zero score.
EVERY_REACHED_TOKEN_METHODS = (AttentionRollout,) + RELEVANCE_METHODS
TARGET = 5


def _model(name):
    torch.manual_seed(0)
    return BUILDERS[name]().eval()


def _inputs():
    """Two sequences of 8 tokens; the second is left-padded by one token."""
    ids = torch.randint(3, 99, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    mask[1, 0] = 0
    return ids, {"attention_mask": mask}


def _reached(attentions, layers):
    """(B, N) True at the tokens the last token reaches through the model's own ``layers`` last
    attention maps (and the residual stream): the tokens an explanation may credit."""
    last = attentions[0].shape[-1] - 1
    reached = torch.zeros(attentions[0].shape[0], attentions[0].shape[-1], dtype=torch.bool)
    reached[:, last] = True
    for probs in reversed(attentions[len(attentions) - layers:]):
        links = (probs != 0).any(dim=1)  # (B, Q, K), over heads
        reached = reached | (reached[:, :, None] & links).any(dim=1)
    return reached


def _eager_attentions(model, ids, kwargs):
    with torch.no_grad():
        return model(ids, output_attentions=True, **kwargs).attentions


@pytest.mark.parametrize("name", MODELS)
def test_layout_masks_padding_only(name):
    model = _model(name)
    ids, kwargs = _inputs()
    trace = RawAttention(model).trace(ids, target=TARGET, forward_kwargs=kwargs)
    assert trace.layout.token_mask.tolist() == kwargs["attention_mask"].bool().tolist()


@pytest.mark.parametrize("name", MODELS)
def test_captured_maps_equal_eager_output_attentions(name):
    model = _model(name)
    ids, kwargs = _inputs()
    expected = _eager_attentions(model, ids, kwargs)
    spec = CaptureSpec(forward_reduce=lambda probs: probs.clone())
    records = run_trace(RawAttention(model).adapter, model, (ids,), (), TARGET, spec, kwargs).records
    assert len(records) == len(expected) == 3
    for record, reference in zip(records, expected):
        # Padded query rows are undefined (every key masked); compare the real ones.
        real = kwargs["attention_mask"].bool()[:, None, :, None]
        torch.testing.assert_close(record.forward_value * real, reference * real, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("method", METHODS)
def test_tokens_reached_through_deeper_layers_get_relevance(name, method):
    model = _model(name)
    ids, kwargs = _inputs()
    attentions = _eager_attentions(model, ids, kwargs)
    layers = 1 if method in LAST_MAP_METHODS else len(attentions)
    reached = _reached(attentions, layers) & kwargs["attention_mask"].bool()
    window = _reached(attentions, 1)
    assert (reached & ~window).any() or layers == 1, "precondition: some token lies outside the last window"

    scores = method(model).attribute(ids, target=TARGET, forward_kwargs=kwargs, return_tokens=True)
    assert torch.isfinite(scores).all()
    assert (scores[~reached] == 0).all(), "padding and tokens the model never reaches get exactly 0"
    if method is AttentionGradCAM:
        return  # its ReLU may legitimately zero a reached token of a random model
    # Methods with a positive part (GenericAttention, TransformerRelevance) may zero some token;
    # every example must credit some token beyond the last window (the fault gave them all 0).
    credited = reached & ~window if layers > 1 else reached
    if method in EVERY_REACHED_TOKEN_METHODS:
        assert (scores[reached] != 0).all(), (scores, reached)
    for example in range(scores.shape[0]):
        assert (scores[example][credited[example]] != 0).any(), (example, scores[example])
