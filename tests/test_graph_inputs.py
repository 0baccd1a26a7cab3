"""Graph batches are described in graph words: nodes, edges and graphs, never tokens or examples.

Keyword edge features are per edge (not refused as a batch-size mismatch), a graph number
with no node is named as such (not as an all-masked attention mask), NaN node features are
"the input holds NaN", and a sparse adjacency matrix is refused before the forward.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

pyg = pytest.importorskip("torch_geometric.nn")

from captum_transformers import ConservativeLRP, GenericAttention, RawAttention  # noqa: E402
from captum_transformers.adapters.graph.pyg_attention import PyGAttentionAdapter  # noqa: E402
from captum_transformers.errors import InputError  # noqa: E402
from captum_transformers.propagation.rules.rule_set import RuleSet  # noqa: E402
from captum_transformers.engine.runner import run_relevance
from pyg_models import CHANNELS, FEATURES, graph_classifier, graphs  # noqa: E402

TOKEN_WORDS = ("token", "example", "attention mask", "batch size")


class EdgeFeatures(nn.Module):
    """A TransformerConv with edge features, taking edge_attr by keyword."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.encode = nn.Linear(FEATURES, CHANNELS)
        self.conv = pyg.TransformerConv(CHANNELS, CHANNELS // 2, heads=2, edge_dim=2)
        self.head = nn.Linear(CHANNELS, 2)

    def forward(self, x, edge_index, batch=None, edge_attr=None):
        return self.head(pyg.global_mean_pool(self.conv(self.encode(x), edge_index, edge_attr), batch))


def _graph_words(error):
    message = str(error.value).lower()
    assert not any(word in message for word in TOKEN_WORDS), message


@pytest.mark.parametrize("method", [GenericAttention, ConservativeLRP])
def test_edge_attr_by_keyword_is_explained_as_when_passed_positionally(method):
    model = EdgeFeatures().eval()
    _, (x, edge_index, batch) = graphs()
    edge_attr = torch.randn(edge_index.shape[1], 2, generator=torch.Generator().manual_seed(1))
    by_name = method(model).attribute(x, additional_forward_args=(edge_index, batch), target=[0, 1, 0],
                                      forward_kwargs={"edge_attr": edge_attr})
    positional = method(model).attribute(x, additional_forward_args=(edge_index, batch, edge_attr), target=[0, 1, 0])
    torch.testing.assert_close(by_name, positional, rtol=0, atol=0)


def test_a_graph_number_without_nodes_is_named_as_such():
    model = graph_classifier("TransformerConv")
    _, (x, edge_index, batch) = graphs()
    batch = torch.where(batch == 2, 3, batch)  # graphs 0, 1, 3: graph 2 has no node
    with pytest.raises(InputError, match=r"graph\(s\) \[2\] have no node") as error:
        RawAttention(model).attribute(x, additional_forward_args=(edge_index, batch))
    _graph_words(error)


def test_nan_node_features_are_the_input_holding_nan():
    model = graph_classifier("TransformerConv")
    _, (x, edge_index, batch) = graphs()
    x = x.clone()
    x[4, 1] = float("nan")
    for explain in (lambda: GenericAttention(model).attribute(x, additional_forward_args=(edge_index, batch),
                                                               target=[0, 1, 0]),
                    lambda: ConservativeLRP(model).attribute(x, additional_forward_args=(edge_index, batch),
                                                             target=[0, 1, 0]),
                    lambda: run_relevance(PyGAttentionAdapter(), model, (x,), (edge_index, batch), [0, 1, 0],
                                                            RuleSet.AH_LN)):
        with pytest.raises(InputError, match=r"The input holds NaN: .* node\(s\) \[4\]") as error:
            explain()
        _graph_words(error)


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_a_sparse_adjacency_is_refused_before_the_forward(layout):
    model = graph_classifier("TransformerConv")
    _, (x, edge_index, batch) = graphs()
    adjacency = torch.sparse_coo_tensor(edge_index, torch.ones(edge_index.shape[1]), (len(x), len(x))).coalesce()
    adjacency = adjacency if layout == "coo" else adjacency.to_sparse_csr()
    for method in (RawAttention, ConservativeLRP):
        with pytest.raises(InputError, match=r"additional_forward_args\[0\] is a sparse adjacency matrix") as error:
            method(model).attribute(x, additional_forward_args=(adjacency, batch), target=[0, 1, 0])
        _graph_words(error)
    # The conversion the message gives: the same (coalesced: repeated edges once) edges, the same maps.
    converted = adjacency.to_sparse_coo().coalesce().indices() if layout == "csr" else adjacency.indices()
    torch.testing.assert_close(
        RawAttention(model).attribute(x, additional_forward_args=(converted, batch), return_tokens=True),
        RawAttention(model).attribute(x, additional_forward_args=(torch.unique(edge_index, dim=1), batch),
                                      return_tokens=True))


def test_a_target_list_not_one_per_graph_and_an_empty_node_list_are_said_in_graph_words():
    model = graph_classifier("TransformerConv")
    _, (x, edge_index, batch) = graphs()
    for method in (GenericAttention, ConservativeLRP):
        with pytest.raises(InputError, match=r"target has 2 entries but the batch holds 3 graphs") as error:
            method(model).attribute(x, additional_forward_args=(edge_index, batch), target=[0, 1])
        _graph_words(error)
    with pytest.raises(InputError, match=r"hold no node") as error:
        RawAttention(model).attribute(x[:0], additional_forward_args=(edge_index[:, :0], batch[:0]))
    _graph_words(error)
