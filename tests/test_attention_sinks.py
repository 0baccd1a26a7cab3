"""Attention sinks (GPT-OSS's ``s_aux``): a learned logit per head appended as a softmax column and
dropped, so each row of the map sums to ``1 - p_sink``.

The package's HF kernel used to refuse every model that passes sinks. It applies them now on every
path (the plain map, the rule-carrying backward passes, the operands of AttnLRP, the constant map of
the AH rules, the row chunks of a streamed map), so a tiny float64 GPT-OSS (sliding and full layers,
grouped-query heads, a mixture of experts) is explained: its captured maps equal its own eager
``output_attentions`` to 1e-12, its plain and AttnLRP gradients equal those of its eager forward, a
padded batch equals single calls for every method, and GenerationAttribution's rows equal calls on
each prefix. Sinks computed from the input (per query) are refused by name.
"""
from __future__ import annotations

import pytest
import torch
from generation_models import IdTokenizer

from captum_transformers import UnsupportedModelError, get_adapter
from captum_transformers.capture.trace import CaptureSpec
from captum_transformers.engine.runner import run_trace
from captum_transformers.generation import GenerationAttribution
from captum_transformers.methods.catalog import KNOWN_METHOD_NAMES, build_method
from captum_transformers.propagation.attention.sinks import constant_sinks, sink_share, sink_softmax
from captum_transformers.propagation.rules.operations import operation_rules
from captum_transformers.propagation.rules.routers import router_rules
from captum_transformers.propagation.rules.rule_set import RuleSet, norm_rules

transformers = pytest.importorskip("transformers")

RAW = CaptureSpec(forward_reduce=lambda probs: probs)
IDS = torch.tensor([[1, 5, 7, 9, 11, 13, 4], [0, 0, 6, 8, 10, 12, 3]])
MASK = (IDS != 0).long()
_MODEL: dict = {}


def gpt_oss() -> torch.nn.Module:
    """Two layers (a 4-token sliding window, then full), 4 query heads over 2 key-value heads, two
    experts; float64 (eager experts: grouped_mm takes no float64), sinks large enough to matter."""
    if "model" not in _MODEL:
        config = transformers.GptOssConfig(
            vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64, pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        torch.manual_seed(0)
        model = transformers.GptOssForCausalLM._from_config(config, attn_implementation="eager",
                                                            experts_implementation="eager").double().eval()
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, 4, dtype=torch.float64))
        _MODEL["model"] = model
    return _MODEL["model"]


def test_captured_maps_equal_the_eager_maps_which_exclude_the_sink():
    model = gpt_oss()
    with torch.no_grad():
        own = model(IDS, attention_mask=MASK, output_attentions=True)
    records = run_trace(get_adapter(model), model, (IDS,), (), 0, RAW, {"attention_mask": MASK}).records
    assert len(records) == len(own.attentions) == 2
    for record, reference in zip(records, own.attentions):
        torch.testing.assert_close(record.forward_value, reference, rtol=0, atol=1e-12)
        share = sink_share(record.forward_value)[MASK.bool()[:, None, :].expand(-1, 4, -1)]  # real queries
        assert bool((share > 0.01).all()) and bool((share < 1).all())  # the sink takes a real share


def test_sink_softmax_is_the_eager_column_concatenation():
    scores = torch.randn(2, 3, 5, 6, dtype=torch.float64)
    sinks = torch.randn(3, dtype=torch.float64)
    column = sinks.reshape(1, -1, 1, 1).expand(2, 3, 5, 1)
    expected = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    torch.testing.assert_close(sink_softmax(scores, sinks, torch.float64), expected, rtol=0, atol=1e-15)
    torch.testing.assert_close(sink_share(expected), 1 - expected.sum(-1), rtol=0, atol=0)


def _embedding_gradient(model, rules, through_kernel: bool):
    """The gradient of a logit at the input embeddings: through the package's kernel (the adapter's
    rule context) or through the model's own eager attention under the same rules."""
    embeds = model.get_input_embeddings()(IDS[:1]).detach().requires_grad_()
    if through_kernel:
        context = get_adapter(model).propagation(model, rules)
    else:
        context = _stack(norm_rules(model, rules), operation_rules(model, rules), router_rules(model, rules))
    with context:
        logit = model(inputs_embeds=embeds).logits[0, -1, 3]
    return torch.autograd.grad(logit, embeds)[0]


class _stack:
    def __init__(self, *contexts):
        self.contexts = contexts

    def __enter__(self):
        for context in self.contexts:
            context.__enter__()

    def __exit__(self, *exc):
        for context in reversed(self.contexts):
            context.__exit__(*exc)


@pytest.mark.parametrize("rules", [RuleSet.GRADIENT, RuleSet.ATTN_LRP], ids=lambda rules: rules.name)
def test_gradients_through_the_kernel_equal_the_eager_forwards(rules):
    """The plain gradient and AttnLRP's (the sink column is a softmax input whose relevance stays
    with the sink, not a column of the map) equal those of the model's own eager attention."""
    model = gpt_oss()
    got = _embedding_gradient(model, rules, True)
    expected = _embedding_gradient(model, rules, False)
    assert got.abs().sum() > 0
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


# (Captum's baselines read a causal LM's (B, N, V) logits only with a position per target.)
METHODS = [name for name in KNOWN_METHOD_NAMES if name not in ("integrated-gradients", "saliency")]


# Chefer et al.'s identity rules pass relevance through ratios y / x that amplify the rounding of a
# padded forward (up to 1e-6 of the map's largest entry here, with the sinks switched off as well).
AMPLIFIED = {"lrp": 1e-5, "transformer-relevance": 1e-5}


@pytest.mark.parametrize("name", METHODS)
def test_a_padded_batch_equals_single_calls(name):
    model = gpt_oss()
    method = build_method(name, model)
    batch = method.attribute(IDS, target=[3, 5], forward_kwargs={"attention_mask": MASK})
    assert batch.abs().sum() > 0
    for row, target in enumerate([3, 5]):
        real = MASK[row].bool()
        alone = method.attribute(IDS[row:row + 1, real], target=target)
        tolerance = AMPLIFIED.get(name, 1e-8) * float(alone.abs().max())
        torch.testing.assert_close(batch[row, real], alone[0], rtol=0, atol=tolerance)
        assert not batch[row, ~real].any()


@pytest.mark.parametrize("name", ["attn-lrp", "generic-attention", "transformer-relevance", "rollout",
                                  "conservative-lrp-ah"])
def test_generation_rows_equal_calls_on_each_prefix(name):
    model = gpt_oss()
    method = build_method(name, model)
    prompt, target = [1, 5, 7, 9, 11], [20, 21, 22]
    result = GenerationAttribution(method, IdTokenizer()).attribute(prompt, target=target)
    assert result.token_attr.abs().sum() > 0
    for t, token in enumerate(target):
        scores = method.attribute(torch.tensor([prompt + target[:t]]), target=token, return_tokens=True)[0]
        torch.testing.assert_close(result.token_attr[t], scores[:len(prompt)], rtol=0, atol=1e-10)
        torch.testing.assert_close(result.target_attr[t, :t], scores[len(prompt):], rtol=0, atol=1e-10)


def test_sinks_computed_from_the_input_are_refused_by_name():
    """Inkling2 passes per-query sinks made from the hidden states: their gradient would reach the
    tokens, which the kernel's constant sinks do not carry."""
    hidden = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    per_query = torch.nn.Linear(8, 4).double()(hidden).transpose(1, 2).unsqueeze(-1)  # (B, H, Q, 1)
    with pytest.raises(UnsupportedModelError, match="computed from its input"):
        constant_sinks(per_query, 4, "Inkling2SlidingAttention")
    with pytest.raises(UnsupportedModelError, match="one constant logit per head"):
        constant_sinks(torch.zeros(2, 4, 5, 1, dtype=torch.float64), 4, "Inkling2SlidingAttention")
    learned = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    assert constant_sinks(learned, 4, "GptOssAttention").data_ptr() == learned.data_ptr()


def test_softmax_attention_applies_the_sinks_on_its_plain_and_batch_chunked_paths(monkeypatch):
    """The attention Function itself: its forward (whole, and a few examples at a time without
    gradients) and its plain backward (the product's gradient by hand) against the eager formula."""
    from captum_transformers.adapters.huggingface.kernel_rows import plain_gradient_of
    from captum_transformers.propagation.attention import core

    torch.manual_seed(0)
    query, key, value = (torch.randn(3, 4, 6, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sinks = torch.tensor([-1.0, 0.0, 1.0, 2.0], dtype=torch.float64)

    def scores(q, k, out=None):
        return torch.matmul(q, k.transpose(-1, -2)) * 0.3

    scores.sinks, scores.plain_gradient, scores.batch_sliceable = sinks, plain_gradient_of(0.3), True
    column = sinks.reshape(1, -1, 1, 1).expand(3, 4, 6, 1)
    expected_map = torch.softmax(torch.cat([scores(query, key), column], dim=-1), dim=-1)[..., :-1]
    expected = torch.matmul(expected_map, value)
    output, probs = core.softmax_attention(scores, query, key, value, softmax_dtype=torch.float64)
    torch.testing.assert_close(probs, expected_map, rtol=0, atol=1e-14)
    torch.testing.assert_close(output, expected, rtol=0, atol=1e-14)
    g = torch.randn_like(output)
    got = torch.autograd.grad(output, (query, key, value), g)
    for a, b in zip(got, torch.autograd.grad(expected, (query, key, value), g)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
    monkeypatch.setattr(core, "_CHUNK_BYTES", 1)  # one example per chunk
    with torch.no_grad():
        output, probs = core.softmax_attention(scores, query, key, value, softmax_dtype=torch.float64)
    torch.testing.assert_close(probs, expected_map, rtol=0, atol=1e-14)
    torch.testing.assert_close(output, expected, rtol=0, atol=1e-14)
