"""One forward under LRP rules, two backward passes (the rules, then the plain gradient).

1. With the backward switch flipped, the graph built under every rule set whose attention
   gate is the gradient gives exactly the plain model's gradient (float64, rounding only),
   and before it the rules' own backward is unchanged by the switch.
2. TransformerRelevance from one forward equals the two-forward computation (a relevance
   trace, then a separate plain-gradient trace) it replaces.
3. The HF kernel's recomputed attention (scores and map) changes no relevance and keeps
   no (B, H, Q, K) tensor for the backward pass.
"""
from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from captum_transformers import RuleSet, TransformerRelevance, get_adapter
from captum_transformers.adapters.relevance_reading import read_layer_input
from captum_transformers.adapters.huggingface import kernel as hf_kernel
from captum_transformers.adapters import torch_mha
from captum_transformers.propagation.backward_switch import switchable_backward
from captum_transformers.capture.trace import CaptureSpec
from captum_transformers.engine.runner import run_trace
from lrp_models import CONSERVATION_CASES, TARGET  # noqa: E402

SWITCHABLE = [pytest.param(rules, id=rules.name) for rules in
              (RuleSet.CHEFER, RuleSet.LRP, RuleSet.ATTN_LRP, dataclasses.replace(RuleSet.CHEFER, name="ScaleNorm",
                                                                                    norm="scale_constant"))]


def _gradients(model, inputs, kwargs, rules):
    """At the first layer's input, for the explained logits: the rule gradient and the plain
    gradient from one forward under ``rules``, the rule gradient of a forward without the
    switch, and the plain gradient of the model."""
    adapter = get_adapter(model)
    layer = adapter.first_layer(model)

    def run(contexts):
        entering = []
        with torch.enable_grad(), read_layer_input(layer, entering):
            with contextlib.ExitStack() as stack:
                switch = stack.enter_context(switchable_backward())
                for context in contexts:
                    stack.enter_context(context)
                output = model(inputs, **(kwargs or {}))
            logits = output.logits if hasattr(output, "logits") else output
            if logits.dim() == 3:  # GPT-2: next-token logits at the last position
                logits = logits[:, -1]
            score = logits[:, TARGET].sum()
            return entering[0], score, switch

    leaf, score, switch = run([adapter.propagation(model, rules)])
    (rule_grad,) = torch.autograd.grad(score, leaf, retain_graph=True)
    with switch.plain_gradient():
        (plain_grad,) = torch.autograd.grad(score, leaf)
    leaf, score, _ = run([adapter.propagation(model, rules)])
    (rule_only,) = torch.autograd.grad(score, leaf)
    # The reference: plain gradients through the same attention kernel (a HF model's own
    # eager path differs from it by rounding, more at padded positions).
    leaf, score, _ = run([adapter.propagation(model, RuleSet.GRADIENT)])
    (reference,) = torch.autograd.grad(score, leaf)
    return rule_grad, plain_grad, rule_only, reference


@pytest.mark.parametrize("rules", SWITCHABLE)
@pytest.mark.parametrize("case", sorted(CONSERVATION_CASES))
def test_switched_graph_gives_the_plain_gradient(case, rules):
    model, inputs, kwargs, _ = CONSERVATION_CASES[case]()
    rule_grad, plain_grad, rule_only, reference = _gradients(model, inputs, kwargs, rules)
    torch.testing.assert_close(plain_grad, reference, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(rule_grad, rule_only, rtol=0, atol=0)  # the switch leaves the rules alone
    assert (rule_grad - reference).abs().max() > 1e-6  # the rules do change the backward


def _two_forward_relevance(explainer, inputs, target, kwargs):
    """TransformerRelevance as it was computed before: a relevance trace under the rules,
    then a separate plain-gradient trace."""
    from captum_transformers import functional
    from captum_transformers.methods.transformer_relevance import _relevance

    adapter, model = explainer.adapter, explainer.model
    first = run_trace(adapter, model, (inputs,), (), target,
                          CaptureSpec(backward_reduce=lambda p, g, v: _relevance(p, g)), kwargs, rules=explainer.rules)
    by_call = {r.call_index: r.backward_value for r in first.records}
    spec = CaptureSpec(backward_reduce=lambda p, g, v, call_index: functional.gradient_weighted_heads(
        by_call[call_index], g, v), pass_call_index=True)
    return explainer.reduce(run_trace(adapter, model, (inputs,), (), target, spec, kwargs))


@pytest.mark.parametrize("case", ["hf_vit", "hf_bert_no_pooler", "timm_vit", "torch_mha_encoder"])
def test_transformer_relevance_from_one_forward_equals_two_forwards(case):
    model, inputs, kwargs, _ = CONSERVATION_CASES[case]()
    explainer = TransformerRelevance(model)
    target = torch.tensor([TARGET, 0, 2])
    one = explainer.attribute(inputs, target=target, forward_kwargs=kwargs, return_tokens=True)
    two = _two_forward_relevance(explainer, inputs, target, kwargs)
    mask = explainer.trace(inputs, target=target, forward_kwargs=kwargs).layout.token_mask
    if mask is not None:
        two = two * mask.to(two.dtype)
    torch.testing.assert_close(one, two, rtol=1e-9, atol=1e-12)
    assert two.abs().max() > 1e-3


def _attention_of_kept_maps(scores_fn, query, key, value, *extras, softmax_dtype=None, observer=None, keep_map=True,
                            kv_groups=1):
    """The attention as separate operations (each under its own rule Function, keeping the
    scores and the map), its map's gradient reported through a tensor hook (``keep_map``: this
    stand-in always keeps it; grouped-query keys and values repeated as operations too)."""
    from captum_transformers.propagation.attention.chunk_products import repeat_heads
    key, value = repeat_heads(key, kv_groups), repeat_heads(value, kv_groups)
    probs = torch.softmax(scores_fn(query, key, *extras), dim=-1, dtype=softmax_dtype).to(query.dtype)
    if observer is not None and probs.requires_grad:
        kept = probs.detach()
        probs.register_hook(lambda grad: observer(kept, grad) if observer.wanted else None)
    return torch.matmul(probs, value), probs


def _keep_maps(monkeypatch, kernel_module):
    monkeypatch.setattr(kernel_module, "softmax_attention", _attention_of_kept_maps)


@pytest.mark.parametrize("name", ["vit", "bert"])
def test_one_forward_equals_two_forwards_in_float32(monkeypatch, name):
    """float32, where the recomputed scores' buffer takes their gradient in place; the
    reference keeps the scores (the softmax rule Function of operation_rules)."""
    from chefer_models import _lively
    from hf_models import CASES

    case = CASES[name]
    model = _lively(case.model())
    inputs, kwargs = case.inputs()
    explainer = TransformerRelevance(model)
    # The dense path (trace): attribute() streams the rows, whose float32 rounding under the identity
    # rules differs (both within 1e-5 of float64; streamed == dense in float64: test_streaming_pairs).
    trace = explainer.trace(inputs, target=1, forward_kwargs=kwargs)
    one = trace.layout.returned(explainer.stream_scores(trace)["tokens"])
    _keep_maps(monkeypatch, hf_kernel)
    two = _two_forward_relevance(explainer, inputs, 1, kwargs)
    mask = explainer.trace(inputs, target=1, forward_kwargs=kwargs).layout.token_mask
    if mask is not None:
        two = two * mask.to(two.dtype)
    torch.testing.assert_close(one, two, rtol=1e-5, atol=1e-6)
    assert two.abs().max() > 1e-3


def _saved_bytes(function) -> int:
    """Bytes of the distinct storages autograd saves for the backward pass while ``function`` runs."""
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function()
    return sum(storages.values())


@pytest.mark.parametrize("case, kernel_module, layers, heads", [("hf_vit", hf_kernel, 2, 4),
                                                                 ("torch_mha_encoder", torch_mha, 2, 2)])
def test_recomputed_scores_change_nothing_and_keep_less(monkeypatch, case, kernel_module, layers, heads):
    model, inputs, kwargs, _ = CONSERVATION_CASES[case]()
    adapter = get_adapter(model)
    explainer = TransformerRelevance(model)

    def forward():
        with adapter.propagation(model, RuleSet.CHEFER):
            model(inputs, **(kwargs or {}))

    def relevance():
        return explainer.attribute(inputs, target=TARGET, forward_kwargs=kwargs, return_tokens=True)

    recomputed_maps, recomputed_bytes = relevance(), _saved_bytes(forward)
    _keep_maps(monkeypatch, kernel_module)
    kept_maps, kept_bytes = relevance(), _saved_bytes(forward)
    torch.testing.assert_close(recomputed_maps, kept_maps, rtol=1e-12, atol=1e-18)  # rounding only
    batch, tokens = recomputed_maps.shape
    scores = layers * batch * heads * tokens * tokens * 8
    if case == "hf_vit":
        # No longer kept per layer: the float64 scores and the float64 softmax output that A V
        # kept (the kernel's softmax runs in the model's float64: no float32 copy to cast).
        assert kept_bytes - recomputed_bytes == scores * (8 + 8) // 8
    else:  # the scores, the softmax output (A V's operand) and the scaled queries Q K^T kept
        head_dim = 16 // heads
        assert kept_bytes - recomputed_bytes == 2 * scores + layers * batch * heads * tokens * head_dim * 8
