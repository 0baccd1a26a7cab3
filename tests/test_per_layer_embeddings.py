"""Gemma 3n and 4 (issue 42, item 3: per-layer embeddings): token relevance read where the ids enter.

Gemma 3n's first layer takes its AltUp copies of the embeddings stacked (copies, B, N, D), and
every layer adds a per-layer embedding of the ids. Its token relevance is therefore read at the
outputs of ``embed_tokens`` and ``embed_tokens_per_layer`` (Gemma 4 has the per-layer embeddings
without AltUp): Gradient x Input equals the sum of
``x * dy/dx`` at both (plain autograd, the model's own backward), every relevance method gives
finite maps with a padded batch equal to single calls, and a reading at the first layer's input
(stacked, not (B, N, ...)) is refused instead of summed along the wrong axis.
"""
from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from captum_transformers import CaptureError  # noqa: E402
from captum_transformers.adapters import Adapter, HuggingFaceAdapter  # noqa: E402
from captum_transformers.methods.catalog import build_method  # noqa: E402

RELEVANCE_METHODS = ("lrp", "attn-lrp", "gradient-x-input", "conservative-lrp-ah", "conservative-lrp")
IDS = torch.tensor([[5, 9, 12, 7, 30, 11], [6, 8, 14, 21, 0, 0]])
MASK = (IDS != 0).long()
TOKEN = 7


def _gemma3n():
    torch.manual_seed(0)
    config = transformers.Gemma3nTextConfig(
        vocab_size=64, vocab_size_per_layer_input=64, hidden_size=32, hidden_size_per_layer_input=8,
        intermediate_size=[64, 64], num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=64, layer_types=["sliding_attention", "full_attention"], sliding_window=4,
        activation_sparsity_pattern=[0.0, 0.0], num_kv_shared_layers=0, laurel_rank=8, pad_token_id=0,
        eos_token_id=1, bos_token_id=2, attn_implementation="sdpa")  # eager runs its softmax in float32
    model = transformers.Gemma3nForCausalLM(config).double().eval()
    with torch.no_grad():  # initialised to 0, which cuts the per-layer embeddings' branch off the output
        for layer in model.model.layers:
            layer.altup.correct_output_scale.uniform_(0.5, 1.5)
    return model


def _last_logits(model, ids, mask):
    logits = model(input_ids=ids, attention_mask=mask).logits
    return logits[torch.arange(ids.shape[0]), mask.sum(1) - 1, TOKEN]


def _gemma4():
    """Gemma 4 (per-layer embeddings of the ids, no AltUp), from the coverage harness's small config."""
    import os
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks.coverage.shrink import build_model, small_config
    model = build_model(small_config("gemma4_text", "Gemma4ForCausalLM", "causal-lm"), "Gemma4ForCausalLM")
    model.set_attn_implementation("sdpa")  # eager runs its softmax in float32
    return model


@pytest.mark.parametrize("build", [_gemma3n, _gemma4], ids=["gemma3n", "gemma4"])
def test_gradient_x_input_is_x_times_gradient_at_both_embeddings(build):
    model = build()
    outputs = {}

    def keep(name):
        def hook(module, args, output):
            output.retain_grad()
            outputs[name] = output
        return hook

    handles = [model.model.embed_tokens.register_forward_hook(keep("tokens")),
               model.model.embed_tokens_per_layer.register_forward_hook(keep("per layer"))]
    try:
        _last_logits(model, IDS, MASK).sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    parts = {name: (out.detach() * out.grad).sum(-1).nan_to_num() * MASK for name, out in outputs.items()}
    assert parts["per layer"].abs().max() > 1e-8  # the per-layer embeddings carry relevance of their own
    model.zero_grad(set_to_none=True)
    maps = build_method("gradient-x-input", model).attribute(IDS, target=TOKEN, forward_kwargs={"attention_mask": MASK})
    torch.testing.assert_close(maps, parts["tokens"] + parts["per layer"], rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("name", RELEVANCE_METHODS)
def test_relevance_maps_are_finite_and_batch_equals_single(name):
    model = _gemma3n()
    method = build_method(name, model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batch = method.attribute(IDS, target=TOKEN, forward_kwargs={"attention_mask": MASK})
        single = method.attribute(IDS[1:, :4], target=TOKEN, forward_kwargs={"attention_mask": MASK[1:, :4]})
    assert torch.isfinite(batch).all()
    assert (batch.abs().sum(-1) > 0).all()
    assert batch[1, 4:].abs().max() == 0
    torch.testing.assert_close(batch[1, :4], single[0], rtol=1e-8, atol=1e-14)


class _FirstLayerReading(HuggingFaceAdapter):
    """The default reading of every adapter: the hidden states entering the first layer."""

    def relevance_reading(self, model, at, messages=None):
        return Adapter.relevance_reading(self, model, at, messages)


def test_stacked_first_layer_input_is_refused():
    model = _gemma3n()
    with pytest.raises(CaptureError, match=r"\(4, 2, 6, 32\).*stacks or reshapes"):
        type(build_method("gradient-x-input", model))(model, adapter=_FirstLayerReading()).attribute(
            IDS, target=TOKEN, forward_kwargs={"attention_mask": MASK})
