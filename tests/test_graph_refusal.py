"""Graph models no adapter explains are refused, never explained as token sequences.

Before the refusal a GPS model went to the torch_mha adapter (its GPSConv holds an
nn.MultiheadAttention over the nodes) and came back with node 0 read as a CLS token.
TransformerConv, GATConv and GATv2Conv go to the pyg_attention adapter, GPSConv to pyg_gps
(tests/test_pyg_*.py), and naming a token adapter for them is refused; an nn.MultiheadAttention
inside another message-passing layer, and linear attention (SGFormer, Polynormer, Performer),
are still refused.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from captum_transformers import UnsupportedModelError, get_adapter
from captum_transformers.adapters.base import Adapter

pyg = pytest.importorskip("torch_geometric.nn")
from torch_geometric.utils import to_dense_batch  # noqa: E402

CHANNELS = 8


class GraphClassifier(nn.Module):
    """Node encoder, one graph layer, mean pool per graph, linear head."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.encode = nn.Linear(3, CHANNELS)
        self.layer = layer
        self.head = nn.Linear(CHANNELS, 2)

    def forward(self, x, edge_index, batch):
        try:
            hidden = self.layer(self.encode(x), edge_index, batch=batch)
        except TypeError:  # convolutions without a batch argument
            hidden = self.layer(self.encode(x), edge_index)
        return self.head(pyg.global_mean_pool(hidden, batch))


class AttentionMessagePassing(pyg.MessagePassing):
    """A hand-written message-passing layer whose update is an nn.MultiheadAttention."""

    def __init__(self):
        super().__init__(aggr="mean")
        self.attention = nn.MultiheadAttention(CHANNELS, 2, batch_first=True)

    def forward(self, x, edge_index):
        mixed, _ = self.attention(x[None], x[None], x[None])
        return self.propagate(edge_index, x=mixed[0])


def _gps():
    gin = pyg.GINConv(nn.Sequential(nn.Linear(CHANNELS, CHANNELS), nn.ReLU(), nn.Linear(CHANNELS, CHANNELS)))
    return GraphClassifier(pyg.GPSConv(CHANNELS, gin, heads=2, dropout=0.0)).eval()


class LinearAttentionLayer(nn.Module):
    """A node layer around one of PyG's linear attentions (no softmax map exists)."""

    def __init__(self, attention: nn.Module):
        super().__init__()
        self.attention = attention

    def forward(self, x, edge_index, batch):
        dense, mask = to_dense_batch(x, batch)
        return self.attention(dense, mask)[mask]


def _linear(kind):
    from torch_geometric.nn.attention import PerformerAttention
    from torch_geometric.nn.attention.polynormer import PolynormerAttention
    from torch_geometric.nn.attention.sgformer import SGFormerAttention

    attention = {"SGFormerAttention": lambda: SGFormerAttention(CHANNELS, heads=1, head_channels=CHANNELS),
                 "PolynormerAttention": lambda: PolynormerAttention(CHANNELS, heads=1, head_channels=CHANNELS),
                 "PerformerAttention": lambda: PerformerAttention(CHANNELS, heads=1, head_channels=CHANNELS)}[kind]()
    return GraphClassifier(LinearAttentionLayer(attention)).eval()


REFUSED = {
    "MessagePassing+MHA": lambda: GraphClassifier(AttentionMessagePassing()).eval(),
    **{kind: (lambda kind=kind: _linear(kind))
       for kind in ("SGFormerAttention", "PolynormerAttention", "PerformerAttention")},
}
SUPPORTED = {
    "GPSConv": _gps,
    "TransformerConv": lambda: GraphClassifier(pyg.TransformerConv(CHANNELS, CHANNELS, heads=1)).eval(),
    "GATConv": lambda: GraphClassifier(pyg.GATConv(CHANNELS, CHANNELS)).eval(),
    "GATv2Conv": lambda: GraphClassifier(pyg.GATv2Conv(CHANNELS, CHANNELS)).eval(),
}


def _graph_batch():
    x = torch.randn(7, 3)
    edge_index = torch.tensor([[0, 1, 1, 2, 3, 4, 5, 6], [1, 0, 2, 1, 4, 5, 6, 3]])
    batch = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    return x, edge_index, batch


@pytest.mark.parametrize("layer", sorted(REFUSED))
def test_a_real_graph_model_runs_and_is_refused_by_lookup(layer):
    model = REFUSED[layer]()
    x, edge_index, batch = _graph_batch()
    assert model(x, edge_index, batch).shape == (2, 2)  # a working graph model
    with pytest.raises(UnsupportedModelError) as error:
        get_adapter(model)
    message = str(error.value)
    assert "graph attention layer" in message and layer.split("+")[0] in message and "adapter=" in message
    if "Attention" in layer:
        assert "linear attention" in message and "no attention map" in message


@pytest.mark.parametrize("layer", sorted(SUPPORTED))
def test_graph_attention_layers_go_to_the_pyg_adapters(layer):
    model = SUPPORTED[layer]()
    assert get_adapter(model).name == ("pyg_gps" if layer == "GPSConv" else "pyg_attention")


@pytest.mark.parametrize("name", ["torch_mha", "huggingface", "timm"])
def test_a_built_in_token_adapter_is_refused_for_a_sparse_attention_layer(name):
    with pytest.raises(UnsupportedModelError, match="TransformerConv.*pyg_attention"):
        get_adapter(SUPPORTED["TransformerConv"](), name)


@pytest.mark.parametrize("name", ["torch_mha", "huggingface", "timm"])
def test_naming_a_built_in_adapter_does_not_bypass_the_refusal(name):
    with pytest.raises(UnsupportedModelError, match="GPSConv"):
        get_adapter(_gps(), name)


def test_a_users_own_adapter_may_take_a_graph_model():
    class GraphAdapter(Adapter):
        name = "my_graph"

        def blocks(self, model):
            return []

        def capture(self, model, recorder):
            raise NotImplementedError

    adapter = GraphAdapter()
    assert get_adapter(_gps(), adapter) is adapter
    # Registered for the user's model class, it is found by the lookup too.
    model = _gps()
    from captum_transformers import register_adapter
    from captum_transformers.adapters import registry

    key = f"{type(model).__module__}.{type(model).__qualname__}"
    register_adapter(key, adapter)
    try:
        assert get_adapter(model) is adapter
    finally:
        registry._BY_KEY.pop(key)
        registry._BY_NAME.pop(adapter.name)


def test_message_passing_without_attention_is_not_refused_as_a_graph_attention():
    model = GraphClassifier(pyg.GCNConv(CHANNELS, CHANNELS))
    with pytest.raises(UnsupportedModelError) as error:
        get_adapter(model)
    assert "No adapter knows" in str(error.value)  # the ordinary "unknown model" refusal
