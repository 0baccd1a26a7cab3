"""The fused attention path of LRP (propagation/fused_attention.py and the HF kernels).

Under rules that are a scaling of the attention operands' gradients (the AH gate: detached Q
and K; AttnLRP: Q, K, V scaled by 1/4, 1/4, 1/2; plain gradients) HF models that run "sdpa"
keep transformers' own SDPA call, and eager models run their operations plainly. Proved here:

1. the scaling equals the explicit rule Functions (attention_core under operation_rules) to
   float64 rounding, on operands that do and do not all carry relevance;
2. AttnLRP and ConservativeLRP maps of the fused path equal those of the explicit path (the
   package before the fused path) on random Llama, Qwen2, Gemma and Mistral, sdpa and eager,
   with padding: 1e-12 in float64, 1e-6 in float32;
3. the fused path is taken when expected (counted calls) and not when a map is wanted;
4. inside propagation the forward of an sdpa model is bit-identical to its own;
5. a trace that wants maps under AttnLRP rules on an sdpa model (the explicit fallback with SDPA's
   masks, causal made explicit) equals the same trace on the eager model.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from captum_transformers import AttnLRP, ConservativeLRP, GenericAttention, RuleSet, get_adapter  # noqa: E402
from captum_transformers.adapters.huggingface import kernel as hf_kernel, kernel_keys as hf_kernel_keys
from captum_transformers.capture.trace import CaptureSpec  # noqa: E402
from captum_transformers.propagation.attention.core import softmax_attention  # noqa: E402
from captum_transformers.propagation.attention.fused import fusable, fused_operands  # noqa: E402
from captum_transformers.propagation.rules.operations import OperationRules  # noqa: E402
from captum_transformers.engine.runner import run_trace
from hf_models import decoder_llm as _llm  # noqa: E402

F64 = torch.float64
FAMILIES = ("llama", "qwen2", "gemma", "mistral")


def _ids():
    ids = torch.randint(1, 53, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :3] = 0  # left padding: the explained token is the last one
    return ids, {"attention_mask": mask}


def _maps(model, method, **kwargs):
    ids, forward_kwargs = _ids()
    return method(model, **kwargs).attribute(ids, target=5, return_tokens=True, forward_kwargs=forward_kwargs)


# == 1. the scaling equals the rule Functions =====================================================
@pytest.mark.parametrize("carries", ["qkv", "qv", "kv", "qk"])
@pytest.mark.parametrize("rules", [RuleSet.ATTN_LRP, RuleSet.AH, RuleSet.GRADIENT], ids=lambda r: r.name)
def test_scaled_operands_equal_the_explicit_rules(rules, carries):
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=generator, dtype=F64) for _ in range(3))
    mask = torch.randn(2, 1, 5, 5, generator=generator, dtype=F64)
    g_out = torch.randn(2, 3, 5, 4, generator=generator, dtype=F64)

    def leaves():
        return [t.clone().requires_grad_(name in carries) for name, t in zip("qkv", (q, k, v))]

    explicit = leaves()
    with OperationRules(rules, 2):
        scores = lambda q_, k_, m: q_ @ k_.transpose(-1, -2) * 0.5 + m  # noqa: E731
        if rules.attention_gate == "constant":
            probs = torch.softmax(scores(*explicit[:2], mask), -1).detach()
            out = probs @ explicit[2]
        else:
            out, _ = softmax_attention(scores, *explicit, mask)
    fused = leaves()
    q_, k_, v_, _ = fused_operands(rules, *fused)
    fused_out = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, scale=0.5)
    torch.testing.assert_close(fused_out, out, rtol=1e-12, atol=1e-12)
    if not out.requires_grad:  # a constant gate over a value that carries nothing
        assert not fused_out.requires_grad
        return
    expected = torch.autograd.grad(out, [t for t in explicit if t.requires_grad], g_out, allow_unused=True)
    out = fused_out
    got = torch.autograd.grad(out, [t for t in fused if t.requires_grad], g_out, allow_unused=True)
    for e, g in zip(expected, got):
        if e is None:
            assert g is None or not g.abs().any()
        else:
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def test_softmax_identity_rule_is_not_fused():
    assert not fusable(RuleSet.CHEFER) and not fusable(RuleSet.LRP)
    q = torch.randn(1, 1, 2, 2, requires_grad=True)
    assert fused_operands(RuleSet.CHEFER, q, q, q) is None
    assert fusable(RuleSet.ATTN_LRP) and fusable(RuleSet.AH_LN) and fusable(RuleSet.GRADIENT)


# == 2. maps equal the explicit path's ============================================================
def _compare(family, impl, dtype, monkeypatch):
    model = _llm(family, impl, dtype)
    fused = {name: _maps(model, m) for name, m in (("attn", AttnLRP), ("cp", ConservativeLRP))}
    _disable(monkeypatch)  # the package as it was before the fused path: the explicit kernel
    explicit = {name: _maps(model, m) for name, m in (("attn", AttnLRP), ("cp", ConservativeLRP))}
    tolerance = 1e-12 if dtype == F64 else 1e-6
    for name in fused:
        scale = explicit[name].abs().max()
        assert scale > 0
        assert float((fused[name] - explicit[name]).abs().max() / scale) < tolerance, (family, impl, name)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_maps_equal_explicit_path_float64(family, impl, monkeypatch):
    _compare(family, impl, F64, monkeypatch)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_maps_equal_explicit_path_float32(impl, monkeypatch):
    _compare("llama", impl, torch.float32, monkeypatch)


def _disable(monkeypatch):
    monkeypatch.setattr(hf_kernel_keys, "fusable", lambda rules: False)
    monkeypatch.setattr(hf_kernel, "fused_operands", lambda *args, **kwargs: None)


# == 3. the fused path is taken when expected =====================================================
@pytest.fixture
def counted(monkeypatch):
    """Counts transformers' SDPA kernel calls and the kernel calls that took scaled operands."""
    from transformers.integrations import sdpa_attention

    counts = {"sdpa": 0, "scaled": 0}
    original_sdpa, original_operands = sdpa_attention.sdpa_attention_forward, hf_kernel.fused_operands

    def sdpa(*args, **kwargs):
        counts["sdpa"] += 1
        return original_sdpa(*args, **kwargs)

    def operands(*args, **kwargs):
        found = original_operands(*args, **kwargs)
        counts["scaled"] += found is not None
        return found

    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", sdpa)
    monkeypatch.setattr(hf_kernel, "fused_operands", operands)
    return counts


@pytest.mark.parametrize("method", [AttnLRP, ConservativeLRP])
def test_sdpa_model_runs_transformers_sdpa(method, counted):
    _maps(_llm("llama", "sdpa"), method)
    assert counted == {"sdpa": 2, "scaled": 2}  # one call per layer


@pytest.mark.parametrize("method, scaled", [(AttnLRP, 2), (ConservativeLRP, 0)])
def test_eager_model_runs_scaled_operands_without_sdpa(method, scaled, counted):
    # Eager models: AttnLRP's operations run plainly over scaled operands; the AH gate keeps its
    # branch (detached map times V), which costs the same.
    _maps(_llm("llama", "eager"), method)
    assert counted == {"sdpa": 0, "scaled": scaled}


def test_no_fused_path_where_a_map_is_wanted_or_the_softmax_rule_needs_scores(counted):
    model = _llm("llama", "sdpa")
    ids, kwargs = _ids()
    GenericAttention(model).attribute(ids, target=5, forward_kwargs=kwargs)
    run_trace(get_adapter(model), model, (ids,), (), 5, _gradient_spec(), kwargs, rules=RuleSet.ATTN_LRP)
    assert counted == {"sdpa": 0, "scaled": 0}


# == 4. forward bit-identical to the sdpa model's own ============================================
@pytest.mark.parametrize("rules", [RuleSet.ATTN_LRP, RuleSet.AH_LN, RuleSet.GRADIENT], ids=lambda r: r.name)
@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_sdpa_forward_bit_identical_inside_propagation(family, rules):
    model = _llm(family, "sdpa")
    ids, kwargs = _ids()
    with torch.enable_grad():
        own = model(ids, **kwargs).logits
        with get_adapter(model).propagation(model, rules):
            inside = model(ids, **kwargs).logits
    assert torch.equal(own, inside)


# == 5. maps wanted under fusable rules on an sdpa model: the explicit fallback ==================
def _gradient_spec():
    return CaptureSpec(forward_reduce=lambda probs: probs.mean(1),
                       backward_reduce=lambda probs, grad, valid: (probs * grad).sum(1))


@pytest.mark.parametrize("padded", [True, False])
def test_trace_under_fusable_rules_on_sdpa_model_equals_eager(padded):
    ids, kwargs = _ids()
    if not padded:
        kwargs = {}  # SDPA's mask is then None: the causal mask must be made explicit
    traces = {}
    for impl in ("sdpa", "eager"):
        model = _llm("llama", impl, F64)
        traces[impl] = run_trace(get_adapter(model), model, (ids,), (), 5, _gradient_spec(), kwargs, rules=RuleSet.ATTN_LRP)
    for sdpa_record, eager_record in zip(traces["sdpa"].records, traces["eager"].records):
        torch.testing.assert_close(sdpa_record.forward_value, eager_record.forward_value, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(sdpa_record.backward_value, eager_record.backward_value, rtol=1e-12, atol=1e-12)
    assert any(r.backward_value.abs().max() > 0 for r in traces["eager"].records)


# == 6. a score that reads the returned attention weights =======================================
def _relevance_with_weights_in_score(model):
    ids, kwargs = _ids()
    embeddings = model.get_input_embeddings()(ids).detach().requires_grad_()
    with get_adapter(model).propagation(model, RuleSet.ATTN_LRP):
        out = model(inputs_embeds=embeddings, output_attentions=True, **kwargs)
        bonus = sum(weights[:, :, -1, :3].sum() for weights in out.attentions)
        (grad,) = torch.autograd.grad(out.logits[:, -1, 5].sum() + bonus, embeddings)
    return grad * embeddings.detach()


def test_gradient_through_returned_weights_equals_explicit_path(monkeypatch, counted):
    model = _llm("llama", "eager", F64)
    fused = _relevance_with_weights_in_score(model)
    assert counted["scaled"] == 2
    _disable(monkeypatch)
    explicit = _relevance_with_weights_in_score(model)
    torch.testing.assert_close(fused, explicit, rtol=1e-12, atol=1e-12)
