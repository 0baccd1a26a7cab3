"""TransformerRelevance on PyG TransformerConv models: Chefer et al.'s normalised adds per graph.

A graph batch is one flat node list, so "per example" (CVPR 2021, Sec. 3.2: the sums of the
relevance of both operands of an add) means per graph: the sums run over each graph's nodes,
given by the batch vector. Proved here: a batch of graphs gets, graph by graph, exactly the
relevance of each graph explained alone; the grouped rule equals the rule applied to each group
on its own; layers adding per-edge tensors stay refused.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("torch_geometric")

from captum_transformers import CaptureError, RuleSet, TransformerRelevance, get_adapter  # noqa: E402
from captum_transformers.propagation.rules.normalized_add import NormalizedAdd  # noqa: E402
from pyg_models import graph_classifier, graphs  # noqa: E402

F64 = torch.float64
TARGETS = [0, 1, 1]


@pytest.mark.parametrize("pool", ["mean", "add"])
def test_a_batch_of_graphs_gets_each_graph_alone(pool, monkeypatch):
    from captum_transformers.propagation.rules import operations as operation_rules

    groups = []

    def recording(a, b, batch_dim, func, args, kwargs, grouped=None):
        groups.append(grouped)
        return NormalizedAdd.apply(a, b, batch_dim, func, args, kwargs, grouped)

    monkeypatch.setattr(operation_rules, "NormalizedAdd", type("Recording", (), {"apply": staticmethod(recording)}))
    model = graph_classifier("TransformerConv", pool=pool).to(F64)
    singles, (x, edge_index, batch) = graphs()
    explainer = TransformerRelevance(model)
    together = explainer.attribute(x.to(F64), additional_forward_args=(edge_index, batch), target=TARGETS)
    # Both residual adds (each TransformerConv's skip) normalised over each graph's nodes.
    assert len(groups) == 2 and all(torch.equal(g, batch) for g in groups)
    start = 0
    for graph, (nodes, edges) in enumerate(singles):
        alone = explainer.attribute(nodes.to(F64), target=[TARGETS[graph]],
                                    additional_forward_args=(edges, torch.zeros(len(nodes), dtype=torch.long)))
        torch.testing.assert_close(together[start:start + len(nodes)], alone, rtol=1e-12, atol=1e-14)
        assert alone.abs().sum() > 0
        start += len(nodes)


def test_grouped_normalised_add_is_the_rule_on_each_group_alone():
    generator = torch.Generator().manual_seed(0)
    groups = torch.tensor([0, 0, 1, 1, 1, 2])
    a, b = (torch.randn(6, 4, generator=generator, dtype=F64, requires_grad=True) for _ in range(2))
    grad = torch.randn(6, 4, generator=generator, dtype=F64)
    grouped = torch.autograd.grad(NormalizedAdd.apply(a, b, 0, torch.add, (a, b), {}, groups), (a, b), grad)
    for group in range(3):
        rows = groups == group
        u, v = a.detach()[rows].requires_grad_(), b.detach()[rows].requires_grad_()
        alone = torch.autograd.grad(NormalizedAdd.apply(u, v, None, torch.add, (u, v), {}), (u, v), grad[rows])
        torch.testing.assert_close(grouped[0][rows], alone[0], rtol=1e-13, atol=1e-15)
        torch.testing.assert_close(grouped[1][rows], alone[1], rtol=1e-13, atol=1e-15)
    # Each graph's rows, not each row: per-row normalisation differs.
    per_row = torch.autograd.grad(NormalizedAdd.apply(a, b, 0, torch.add, (a, b), {}), (a, b), grad)
    assert not torch.allclose(per_row[0], grouped[0])


def test_layers_adding_per_edge_tensors_are_refused():
    import torch_geometric.nn as pyg

    model = graph_classifier("TransformerConv")
    model.convs[1] = pyg.TransformerConv(8, 4, heads=2, edge_dim=2)
    adapter = get_adapter(model)
    adds_only = dataclasses.replace(RuleSet.GRADIENT, name="adds", add="normalized")
    with pytest.raises(CaptureError, match="add per-edge tensors"):
        adapter.refuse_rules(model, adapter.blocks(model), adds_only, graph_adds=True)
    with pytest.raises(CaptureError, match="edge_dim"):  # TransformerRelevance's rules: the softmax rule first
        x, arguments = _batch_of(graphs())
        TransformerRelevance(model).attribute(x, additional_forward_args=arguments, target=TARGETS)
    adapter.refuse_rules(model, adapter.blocks(model)[:1], adds_only, graph_adds=True)  # no edge features there
    with pytest.raises(CaptureError, match="not a batch dimension"):  # without per-graph adds (GPS's call)
        adapter.refuse_rules(model, adapter.blocks(model)[:1], adds_only)


def _batch_of(made):
    _, (x, edge_index, batch) = made
    return x, (edge_index, batch)


def test_adds_of_rows_that_are_neither_nodes_nor_graphs_are_refused():
    from captum_transformers.propagation.rules.normalized_add import row_groups

    groups = torch.tensor([0, 0, 1, 1, 1])
    assert row_groups(groups, torch.zeros(5, 4)) is groups
    assert row_groups(groups, torch.zeros(2, 4)) is None  # one row per graph (after pooling)
    with pytest.raises(CaptureError, match=r"shape \(7, 2, 4\).*neither nodes nor graphs"):
        row_groups(groups, torch.zeros(7, 2, 4))  # e.g. 7 edges
