"""Norm and activation probes are remembered per module state (propagation/probe_cache.py).

A repeated explanation does not probe again; a weight changed in place, replaced, or a
module of another class is probed afresh, so a remembered answer never outlives what it
was measured on.
"""
from __future__ import annotations

import torch
from torch import nn

from captum_transformers.propagation.rules import activation_discovery, rule_set as rules
from captum_transformers.propagation.rules.probe_cache import forget, probed


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.act = _HandGelu()

    def forward(self, x):
        return self.act(self.norm(x))


class _HandGelu(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1 + torch.tanh(0.79788456 * (x + 0.044715 * x ** 3)))


def _count(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_norm_probe_runs_once_per_state(monkeypatch):
    model = _Tiny()
    calls = _count(monkeypatch, rules, "_probe")
    first = rules.find_norms(model)
    rules.find_norms(model)
    assert len(calls) == 1 and [s.name for s in first] == ["norm"]
    with torch.no_grad():
        model.norm.weight.mul_(2.0)  # in place: the version counter moves
    again = rules.find_norms(model)
    assert len(calls) == 2
    torch.testing.assert_close(again[0].scale, first[0].scale * 2)
    model.norm.weight = nn.Parameter(torch.full((8,), 3.0))  # replaced
    torch.testing.assert_close(rules.find_norms(model)[0].scale, torch.full((8,), 3.0))
    assert len(calls) == 3


def test_activation_probe_runs_once_and_follows_the_class(monkeypatch):
    module, like = _HandGelu(), torch.zeros(1)
    calls = _count(monkeypatch, activation_discovery, "_probe_activation")
    assert activation_discovery.is_activation(module, like)
    assert activation_discovery.is_activation(module, like)
    assert len(calls) == 1
    module.__class__ = type("Linearish", (nn.Module,), {"forward": lambda self, x: x})  # now the identity
    assert not activation_discovery.is_activation(module, like)
    assert len(calls) == 2


def test_modules_holding_tensors_are_no_activations_without_a_probe(monkeypatch):
    calls = _count(monkeypatch, activation_discovery, "_probe_activation")
    scaled = _HandGelu()
    scaled.slope = nn.Parameter(torch.ones(1))  # a learned activation: relevance is not its to pass
    buffered = _HandGelu()
    buffered.register_buffer("shift", torch.zeros(1))
    counted = _HandGelu()
    counted.register_buffer("steps", torch.zeros(1, dtype=torch.long))  # an integer buffer is no parameter
    like = torch.zeros(1)
    assert not activation_discovery.is_activation(scaled, like)
    assert not activation_discovery.is_activation(buffered, like)
    assert not activation_discovery.is_activation(nn.Linear(2, 2), like)
    assert calls == []
    assert activation_discovery.is_activation(counted, like) and len(calls) == 1


def test_probed_keys_and_forget():
    module, answers = nn.ReLU(), iter(range(10))
    assert probed(module, "a", lambda: next(answers)) == 0
    assert probed(module, "a", lambda: next(answers)) == 0
    assert probed(module, "b", lambda: next(answers)) == 1
    forget(module)
    assert probed(module, "a", lambda: next(answers)) == 2


def test_maps_unchanged_by_remembered_probes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Tiny(), nn.Linear(8, 3))
    x = torch.randn(4, 8)
    # A model without attention: relevance read at the inputs through Captum inside propagation.
    from captum.attr import InputXGradient
    from captum_transformers import RuleSet
    from captum_transformers.propagation.rules.operations import operation_rules
    from captum_transformers.propagation.rules.rule_set import norm_rules

    def relevance():
        with norm_rules(model, RuleSet.ATTN_LRP), operation_rules(model, RuleSet.ATTN_LRP):
            return InputXGradient(model).attribute(x.clone().requires_grad_(), target=1)

    first, second = relevance(), relevance()
    assert torch.equal(first, second)
    with torch.no_grad():
        model[1].norm.weight.add_(1.0)
    assert not torch.allclose(relevance(), first)

