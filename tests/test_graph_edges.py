"""Edge relevance: the relevance of each edge's message, conserved layer by layer."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch_geometric")

from captum_transformers import ConservativeLRP  # noqa: E402
from captum_transformers.errors import InputError  # noqa: E402
from captum_transformers.integrations.pyg import edge_relevance  # noqa: E402
from captum_transformers.integrations.pyg.edges import on_user_edges  # noqa: E402
from pyg_models import graph_classifier, graphs  # noqa: E402

TARGETS = [0, 1, 1]


def _bias_free(kind):
    model = graph_classifier(kind, bias=False).double()
    for conv in model.convs:
        conv.root_weight = False  # TransformerConv's skip term would carry a share of its own
    return model


@pytest.mark.parametrize("kind", ["TransformerConv", "GATConv", "GATv2Conv"])
@pytest.mark.parametrize("rules", ["AH", "AH+LN"])
def test_each_layers_edge_relevance_sums_to_the_logit_of_its_graph(kind, rules):
    model = _bias_free(kind)
    _, (x, edge_index, batch) = graphs()
    x = x.double()
    result = edge_relevance(model, x, edge_index, batch=batch, target=TARGETS, rules=rules)
    logits = model(x, edge_index, batch)[torch.arange(3), TARGETS].detach()
    assert result.edges.shape == (2, edge_index.shape[1]) and result.layers == ("convs.0", "convs.1")
    for layer in range(2):
        per_graph = torch.zeros(3, dtype=torch.float64).index_add_(0, batch[edge_index[1]], result.edges[layer])
        per_graph.index_add_(0, batch, result.self_loops[layer])
        torch.testing.assert_close(per_graph, logits, rtol=0, atol=1e-12)
    # GAT layers add self-loops, whose share is reported per node; TransformerConv adds none.
    assert (result.self_loops.abs().sum() > 0) == (kind != "TransformerConv")
    # The node relevance of the same pass is ConservativeLRP's.
    expected = ConservativeLRP(model, variant=rules).attribute(x, additional_forward_args=(edge_index, batch),
                                                               target=TARGETS)
    torch.testing.assert_close(result.nodes, expected, rtol=0, atol=1e-12)


def test_a_root_term_takes_its_share():
    model = graph_classifier("TransformerConv", bias=False).double()  # root_weight on: out = sum_j m_ij + W x_i
    _, (x, edge_index, batch) = graphs()
    x = x.double()
    result = edge_relevance(model, x, edge_index, batch=batch, target=TARGETS, rules="AH")
    logits = model(x, edge_index, batch)[torch.arange(3), TARGETS].detach()
    per_graph = torch.zeros(3, dtype=torch.float64).index_add_(0, batch[edge_index[1]], result.edges[1])
    assert not torch.allclose(per_graph, logits)  # the messages alone do not carry all of it


def test_repeated_edges_share_and_added_loops_go_to_nodes():
    user = torch.tensor([[0, 0, 1], [1, 1, 0]])  # 0 -> 1 twice
    used = torch.tensor([[0, 1, 0, 1], [1, 0, 0, 1]])  # as a layer sees it: duplicates merged, loops added
    relevance = torch.tensor([4.0, 1.0, 0.5, 0.25])
    on_edges, loops = on_user_edges(used, relevance, user, 2)
    assert on_edges.tolist() == [2.0, 2.0, 1.0] and loops.tolist() == [0.5, 0.25]
    assert on_edges.sum() + loops.sum() == relevance.sum()


def test_edge_relevance_needs_a_graph_attention_model():
    from tiny_models import EncoderClassifier

    with pytest.raises(InputError, match="pyg_attention"):
        edge_relevance(EncoderClassifier().eval(), torch.randn(3, 4), torch.tensor([[0], [1]]))
