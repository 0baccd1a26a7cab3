"""GenerationAttribution in an evaluation loop: nothing a call creates outlives it.

The engine keeps one forward graph alive across the explained tokens' backward passes (hooks
and observers on it, the recorder's sites): all of it must be freed by reference counting when
the call returns, for every kind of method (a trace method with one and with two backward
passes per token, a forward-only one, a relevance method, Captum's rows)."""
from __future__ import annotations

import gc

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from captum_transformers.generation import GenerationAttribution
from captum_transformers.methods.catalog import METHOD_FACTORIES
from generation_models import IdTokenizer

CALLS = 8


def _live_tensors() -> int:
    return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("method", ["attn-lrp", "generic-attention", "transformer-relevance", "rollout", "saliency"])
def test_repeated_calls_leave_no_tensor_behind(llama, method):
    explainer = GenerationAttribution(METHOD_FACTORIES[method](llama), IdTokenizer())
    call = lambda: explainer.attribute([[1, 5, 7, 9], [1, 6]], target=[[11, 12, 13], [14, 15]])  # noqa: E731
    call()  # warm-up: caches that live for the process
    gc.collect()
    gc.disable()
    try:
        before = _live_tensors()
        for _ in range(CALLS):
            call()
        after = _live_tensors()
    finally:
        gc.enable()
    assert after == before, f"{after - before} tensors outlived {CALLS} calls without a collection"
