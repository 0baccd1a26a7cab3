"""The identity softmax rule on PyG's TransformerConv (adapters/pyg_softmax_rule.py): relevance
conserved in float64 on bias-free layers, equal to a slow dense reference that runs
torch.softmax under the package's own identity rule, the forward unchanged, and the
cases it cannot reach refused."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

pytest.importorskip("torch_geometric")

import torch_geometric.nn as pyg  # noqa: E402

from captum_transformers import get_adapter  # noqa: E402
from captum_transformers.errors import CaptureError  # noqa: E402
from captum_transformers.methods.catalog import METHOD_FACTORIES  # noqa: E402
from captum_transformers.methods.lrp import RuleGradientXInput  # noqa: E402
from captum_transformers.propagation.rules.operations import operation_rules  # noqa: E402
from captum_transformers.propagation.rules.rule_set import RuleSet  # noqa: E402
from pyg_models import graph_classifier, graphs  # noqa: E402

TARGETS = [0, 1, 1]
# Chefer et al.'s rules without their normalised adds (a graph batch has no batch dimension
# to normalise along): identity softmax and activations, alpha=1/beta=0 linear layers with one
# denominator, halved products.
CHEFER_PLAIN_ADDS = RuleSet("Chefer2021 (plain adds)", linear="alpha1beta0", activation="identity",
                            softmax="identity", matmul="uniform")
# The identity softmax and halved products with the plain gradient elsewhere: conservative on
# bias-free layers (no norm, no activation in the test model).
IDENTITY_SOFTMAX = RuleSet("identity softmax", softmax="identity", matmul="uniform")


def _bias_free_model():
    model = graph_classifier("TransformerConv", bias=False).double()
    for conv in model.convs:
        conv.lin_skip.bias = None
    return model


class _DenseReference(nn.Module):
    """The same classifier, one graph at a time with dense maps: ``A = softmax(Q K^T / sqrt(C))``
    over each node's incoming edges (``torch.softmax``, non-edges at -inf), ``A V`` per head plus
    the root term, a mean over the nodes, the head. Under ``operation_rules`` its softmax gets
    the package's identity rule by the ordinary interception of ``torch.softmax``."""

    def __init__(self, model, sizes, edge_index):
        super().__init__()
        self.model, self.sizes, self.edge_index = model, sizes, edge_index

    def forward(self, x):
        logits, start = [], 0
        for size in self.sizes:
            inside = (self.edge_index[0] >= start) & (self.edge_index[0] < start + size)
            source, target = self.edge_index[:, inside] - start
            incoming = torch.zeros(size, size, dtype=torch.bool)
            incoming[target, source] = True  # row = target node, column = source node
            hidden = self.model.encode(x[start:start + size])
            for conv in self.model.convs:
                heads, width = conv.heads, conv.out_channels
                q = conv.lin_query(hidden).view(size, heads, width).transpose(0, 1)
                k = conv.lin_key(hidden).view(size, heads, width).transpose(0, 1)
                v = conv.lin_value(hidden).view(size, heads, width).transpose(0, 1)
                scores = (q @ k.transpose(-1, -2) / math.sqrt(width)).masked_fill(~incoming, float("-inf"))
                attention = torch.softmax(scores, dim=-1)
                hidden = (attention @ v).transpose(0, 1).reshape(size, heads * width) + conv.lin_skip(hidden)
            logits.append(self.model.head(hidden.mean(0, keepdim=True)))
            start += size
        return torch.cat(logits)


def test_relevance_is_conserved_in_float64_on_bias_free_layers():
    model = _bias_free_model()
    _, (x, edge_index, batch) = graphs()
    x = x.double()
    relevance, delta = RuleGradientXInput(model, IDENTITY_SOFTMAX).attribute(
        x, additional_forward_args=(edge_index, batch), target=TARGETS, return_convergence_delta=True)
    logits = model(x, edge_index, batch)[torch.arange(3), TARGETS].detach()
    assert logits.abs().min() > 1e-3
    per_graph = torch.zeros(3, dtype=torch.float64).index_add_(0, batch, relevance.sum(-1))
    torch.testing.assert_close(per_graph, logits, rtol=0, atol=1e-12)
    assert delta.abs().max() < 1e-12
    # The test can fail: the plain softmax gradient with the same other rules does not conserve.
    plain_softmax = dataclasses.replace(IDENTITY_SOFTMAX, softmax="gradient")
    _, plain_delta = RuleGradientXInput(model, plain_softmax).attribute(
        x, additional_forward_args=(edge_index, batch), target=TARGETS, return_convergence_delta=True)
    assert plain_delta.abs().max() > 1e-6


@pytest.mark.parametrize("rules", [IDENTITY_SOFTMAX, CHEFER_PLAIN_ADDS, RuleSet.LRP], ids=lambda rules: rules.name)
def test_relevance_equals_a_dense_reference_with_torch_softmax(rules):
    model = graph_classifier("TransformerConv", seed=3).double()
    singles, (x, edge_index, batch) = graphs(sizes=(4, 6, 5), seed=2)  # no repeated edge (the chord of a triangle is one)
    x = x.double()
    sparse = RuleGradientXInput(model, rules).attribute(x, additional_forward_args=(edge_index, batch),
                                                        target=TARGETS)
    dense = _DenseReference(model, [len(g[0]) for g in singles], edge_index)
    with torch.no_grad():
        torch.testing.assert_close(dense(x), model(x, edge_index, batch), rtol=1e-12, atol=1e-12)
    leaf = x.clone().requires_grad_()
    with operation_rules(dense, rules):
        chosen = dense(leaf)[torch.arange(3), TARGETS]
    # The relevance put on the output: the logit, or 1 (RuleSet.LRP's seed), i.e. gradient 1 / logit.
    seed = torch.ones_like(chosen) if rules.seed == "logit" else 1 / chosen.detach()
    (grad,) = torch.autograd.grad(chosen, leaf, seed)
    expected = leaf.detach() * grad
    torch.testing.assert_close(sparse, expected, rtol=1e-9, atol=1e-12)
    # The test can fail: without the rule on PyG's softmax the relevance differs.
    plain = RuleGradientXInput(model, dataclasses.replace(rules, softmax="gradient")).attribute(
        x, additional_forward_args=(edge_index, batch), target=TARGETS)
    assert not torch.allclose(plain, expected, rtol=1e-3, atol=1e-6)


def test_forward_unchanged_and_partial_lrp_reads_the_rule_path():
    model = graph_classifier("TransformerConv")
    _, (x, edge_index, batch) = graphs()
    before = model(x, edge_index, batch)
    with torch.enable_grad(), get_adapter(model).propagation(model, RuleSet.LRP):
        during = model(x, edge_index, batch)
    assert torch.equal(before, during)
    maps = METHOD_FACTORIES["partial-lrp"](model).attribute(x, additional_forward_args=(edge_index, batch),
                                                            target=TARGETS, return_tokens=True)
    assert maps.shape == (3, 5) and torch.isfinite(maps).all() and maps.abs().sum() > 0


@pytest.mark.parametrize("case", ["GATConv", "edge features"])  # normalised adds: test_pyg_transformer_relevance
def test_cases_the_rule_cannot_reach_are_refused(case):
    _, (x, edge_index, batch) = graphs()
    name, match = "lrp", "TransformerConv layers only"
    if case == "GATConv":
        model = graph_classifier("GATConv")
    elif case == "edge features":
        model = graph_classifier("TransformerConv")
        model.convs[0] = pyg.TransformerConv(8, 4, heads=2, edge_dim=2).eval()
        match = "edge features"
    with pytest.raises(CaptureError, match=match):
        METHOD_FACTORIES[name](model).attribute(x, additional_forward_args=(edge_index, batch), target=TARGETS)


@pytest.mark.parametrize("name", ["lrp", "partial-lrp"])
def test_exact_restore_after_an_error_mid_forward(name):
    from restore import assert_same, raising_after, snapshot

    model = graph_classifier("TransformerConv")
    _, (x, edge_index, batch) = graphs()
    with torch.no_grad():
        before_output = model(x, edge_index, batch)
    hooks = lambda: [(len(conv._message_forward_hooks), len(conv._propagate_forward_hooks)) for conv in model.convs]  # noqa: E731
    before, before_hooks = snapshot(model), hooks()
    with raising_after(model.convs[1], KeyboardInterrupt()):
        with pytest.raises(KeyboardInterrupt):
            METHOD_FACTORIES[name](model).attribute(x, additional_forward_args=(edge_index, batch), target=TARGETS)
    assert_same(before, snapshot(model))
    assert hooks() == before_hooks
    with torch.no_grad():
        assert torch.equal(before_output, model(x, edge_index, batch))


def test_another_thread_gets_the_plain_gradient_while_one_explains():
    import threading

    model = graph_classifier("TransformerConv")
    _, (x, edge_index, batch) = graphs()

    def plain_gradient():
        leaf = x.clone().requires_grad_()
        (grad,) = torch.autograd.grad(model(leaf, edge_index, batch)[torch.arange(3), TARGETS].sum(), leaf)
        return grad

    expected_gradient = plain_gradient()
    explainer = METHOD_FACTORIES["lrp"](model)
    expected_relevance = explainer.attribute(x, additional_forward_args=(edge_index, batch), target=TARGETS)
    gradients, relevances, stop = [], [], threading.Event()

    def bystander():
        while not stop.is_set():
            gradients.append(plain_gradient())

    def explain():
        for _ in range(5):
            relevances.append(explainer.attribute(x, additional_forward_args=(edge_index, batch), target=TARGETS))

    reader, writer = threading.Thread(target=bystander), threading.Thread(target=explain)
    reader.start()
    writer.start()
    writer.join()
    stop.set()
    reader.join()
    assert gradients and all(torch.equal(g, expected_gradient) for g in gradients)
    assert all(torch.equal(r, expected_relevance) for r in relevances)
    # The test can fail: the rule's relevance is not the plain Gradient x Input.
    assert not torch.allclose(expected_relevance, x * expected_gradient, rtol=1e-3, atol=1e-6)
