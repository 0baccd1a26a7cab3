"""Node-dropping pools between attention layers: the later maps land on the kept nodes.

``TopKPooling`` keeps some nodes of each graph and renumbers them; the attention layer after
it indexes the new list. The truth below is built by hand from the pool's ``perm`` and the
layer's own ``return_attention_weights``; pools that merge nodes, and attention layers called
on a node subset made otherwise, are refused.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

pyg = pytest.importorskip("torch_geometric.nn")

from captum_transformers import (AttentionRollout, ConservativeLRP, GenericAttention,  # noqa: E402
                                 RawAttention)
from captum_transformers.adapters.graph.pyg_attention import PyGAttentionAdapter  # noqa: E402
from captum_transformers.errors import CaptureError  # noqa: E402
from pyg_models import CHANNELS, FEATURES, graphs  # noqa: E402

SIZES = (6, 4, 5)


class Pooled(nn.Module):
    """Encoder, TransformerConv, a node-dropping pool, TransformerConv, mean pooling, head."""

    def __init__(self, pool: str = "topk"):
        super().__init__()
        self.encode = nn.Linear(FEATURES, CHANNELS)
        self.conv1 = pyg.TransformerConv(CHANNELS, CHANNELS // 2, heads=2)
        self.pool = (pyg.TopKPooling(CHANNELS, ratio=0.5) if pool == "topk" else pyg.SAGPooling(CHANNELS, ratio=0.5)
                     if pool == "sag" else pyg.EdgePooling(CHANNELS))
        self.conv2 = pyg.TransformerConv(CHANNELS, CHANNELS // 2, heads=2)
        self.head = nn.Linear(CHANNELS, 2)

    def forward(self, x, edge_index, batch):
        hidden = self.conv1(self.encode(x), edge_index)
        pooled = self.pool(hidden, edge_index, batch=batch)
        hidden, edge_index, batch = pooled[0], pooled[1], pooled[3 if not isinstance(self.pool, pyg.EdgePooling)
                                                                 else 2]
        return self.head(pyg.global_mean_pool(self.conv2(hidden, edge_index), batch))


def _pooled(pool="topk", seed=0):
    torch.manual_seed(seed)
    return Pooled(pool).eval()


def _truth(model, x, edge_index, batch):
    """RawAttention's truth: conv2's head-mean map placed on the original nodes, each graph's
    row the mean over its kept nodes."""
    with torch.no_grad():
        hidden = model.conv1(model.encode(x), edge_index)
        kept, kept_edges, _, kept_batch, perm, _ = model.pool(hidden, edge_index, batch=batch)
        _, (used, alpha) = model.conv2(kept, kept_edges, return_attention_weights=True)
    counts = torch.bincount(batch)
    position = torch.arange(len(batch)) - (counts.cumsum(0) - counts)[batch]
    maps = torch.zeros(len(counts), int(counts.max()), int(counts.max()), dtype=torch.float64)
    source, target = perm[used[0]], perm[used[1]]
    maps.index_put_((batch[target], position[target], position[source]), alpha.mean(-1).double(), accumulate=True)
    weights = torch.zeros(len(counts), int(counts.max()), dtype=torch.float64)
    kept_counts = torch.bincount(kept_batch)
    weights[batch[perm], position[perm]] = 1.0 / kept_counts[batch[perm]].double()
    return torch.einsum("bi,bij->bj", weights, maps), weights


@pytest.mark.parametrize("pool", ["topk", "sag"])
def test_maps_after_a_node_dropping_pool_land_on_the_kept_nodes(pool):
    model = _pooled(pool)
    _, (x, edge_index, batch) = graphs(SIZES, seed=3)
    expected, weights = _truth(model, x, edge_index, batch)
    # SAGPooling scores nodes with a GraphConv, message passing outside the maps: the user opts in.
    adapter = PyGAttentionAdapter(ignore_message_passing=pool == "sag")
    found = RawAttention(model, adapter=adapter).attribute(x, additional_forward_args=(edge_index, batch),
                                                           return_tokens=True)
    torch.testing.assert_close(found.double(), expected)
    kept = weights > 0
    assert (found[~kept & (torch.arange(max(SIZES)) < torch.tensor(SIZES)[:, None])] == 0).all()  # dropped: 0
    assert found.abs().sum() > 0  # (a graph whose kept nodes keep no edge between them has a zero map: the truth)


def test_every_method_explains_a_pooled_model_or_the_graph_one_at_a_time():
    model = _pooled("topk")
    singles, (x, edge_index, batch) = graphs(SIZES, seed=3)
    for method in (RawAttention, AttentionRollout, GenericAttention):
        tokens = method(model).attribute(x, additional_forward_args=(edge_index, batch), target=[0, 1, 0],
                                         return_tokens=True)
        for g, (gx, gedges) in enumerate(singles):
            alone = method(model).attribute(gx, additional_forward_args=(gedges, torch.zeros(len(gx), dtype=torch.long)),
                                            target=[0, 1, 0][g], return_tokens=True)
            torch.testing.assert_close(tokens[g:g + 1, :len(gx)], alone, rtol=1e-4, atol=1e-6)
    assert ConservativeLRP(model).attribute(x, additional_forward_args=(edge_index, batch),
                                            target=[0, 1, 0]).shape == x.shape


def test_a_pool_that_merges_nodes_is_refused():
    model = _pooled("edge")
    _, (x, edge_index, batch) = graphs(SIZES, seed=3)
    with pytest.raises(CaptureError, match="no one original node"):
        RawAttention(model).attribute(x, additional_forward_args=(edge_index, batch))


class Indexed(nn.Module):
    """The second attention layer runs on a node subset made by indexing, not by a PyG pool."""

    def __init__(self):
        super().__init__()
        self.encode = nn.Linear(FEATURES, CHANNELS)
        self.conv1 = pyg.TransformerConv(CHANNELS, CHANNELS // 2, heads=2)
        self.conv2 = pyg.TransformerConv(CHANNELS, CHANNELS // 2, heads=2)
        self.head = nn.Linear(CHANNELS, 2)

    def forward(self, x, edge_index, batch):
        hidden = self.conv1(self.encode(x), edge_index)
        keep = torch.arange(len(x)) % 2 == 0
        renumber = torch.cumsum(keep.long(), 0) - 1
        edges = edge_index[:, keep[edge_index[0]] & keep[edge_index[1]]]
        return self.head(pyg.global_mean_pool(self.conv2(hidden[keep], renumber[edges]), batch[keep],
                                              size=int(batch.max()) + 1))


def test_an_attention_layer_on_a_node_subset_made_otherwise_is_refused():
    torch.manual_seed(0)
    model = Indexed().eval()
    _, (x, edge_index, batch) = graphs(SIZES, seed=3)
    with pytest.raises(CaptureError, match="was called on 8 nodes, but the batch has 15 nodes"):
        RawAttention(model).attribute(x, additional_forward_args=(edge_index, batch))


def test_edge_relevance_after_a_pool_lands_on_the_edges_between_kept_nodes():
    from captum_transformers.integrations.pyg.edges import edge_relevance

    model = _pooled("topk")
    _, (x, edge_index, batch) = graphs(SIZES, seed=3)
    with torch.no_grad():
        perm = model.pool(model.conv1(model.encode(x), edge_index), edge_index, batch=batch)[4]
    kept = torch.zeros(len(x), dtype=torch.bool)
    kept[perm] = True
    relevance = edge_relevance(model, x, edge_index, batch=batch, target=[0, 1, 0], rules="AH")
    assert relevance.layers == ("conv1", "conv2")
    between_kept = kept[edge_index[0]] & kept[edge_index[1]]
    assert (relevance.edges[1][~between_kept] == 0).all()
    assert (relevance.edges[1][between_kept] != 0).any()
    assert (relevance.edges[0] != 0).any()


class ParallelPools(nn.Module):
    """Two TopK pools on parallel branches, both fed conv1's output: pool_a keeps 5 of 6 nodes,
    conv2 runs on them; pool_b, scored by a given ``attn`` falling with the node number, keeps
    nodes 0, 1, 2 of the original list, and conv3 runs on them. Composing pool_b's ``perm`` with
    pool_a's would place conv3's maps on pool_a's nodes 0, 1, 2, which are other nodes."""

    def __init__(self):
        super().__init__()
        self.encode = nn.Linear(FEATURES, CHANNELS)
        self.conv1 = pyg.TransformerConv(CHANNELS, CHANNELS // 2, heads=2)
        self.pool_a = pyg.TopKPooling(CHANNELS, ratio=0.7)
        self.conv2 = pyg.TransformerConv(CHANNELS, CHANNELS // 2, heads=2)
        self.pool_b = pyg.TopKPooling(CHANNELS, ratio=0.5)
        with torch.no_grad():
            self.pool_b.select.weight.fill_(1.0)
        self.conv3 = pyg.TransformerConv(CHANNELS, CHANNELS // 2, heads=2)
        self.head = nn.Linear(CHANNELS, 2)

    def forward(self, x, edge_index, batch):
        hidden = self.conv1(self.encode(x), edge_index)
        kept_a, edges_a, _, batch_a, _, _ = self.pool_a(hidden, edge_index, batch=batch)
        left = pyg.global_mean_pool(self.conv2(kept_a, edges_a), batch_a)
        falling = -torch.arange(len(x), dtype=hidden.dtype)[:, None].expand(-1, CHANNELS)
        kept_b, edges_b, _, batch_b, perm_b, _ = self.pool_b(hidden, edge_index, batch=batch, attn=falling)
        assert perm_b.tolist() == [0, 1, 2]
        right = pyg.global_mean_pool(self.conv3(kept_b, edges_b), batch_b)
        return self.head(left + right)


def test_two_pools_on_parallel_branches_fed_the_same_nodes_are_refused_naming_both():
    torch.manual_seed(0)
    model = ParallelPools().eval()
    (x, edge_index), = graphs((6,), seed=3)[0]
    batch = torch.zeros(6, dtype=torch.long)
    with pytest.raises(CaptureError, match=r"'pool_b' \(TopKPooling\) was called on 6 nodes, but the node list after "
                                           r"'pool_a', which kept 5 of the batch's 6 nodes, has 5"):
        RawAttention(model).attribute(x, additional_forward_args=(edge_index, batch))


def test_chained_pools_are_still_followed():
    from captum_transformers.adapters.graph.pooling import SurvivingNodes

    torch.manual_seed(0)
    first, second = pyg.TopKPooling(CHANNELS, ratio=0.5), pyg.TopKPooling(CHANNELS, ratio=0.5)
    _, (x, edge_index, batch) = graphs(SIZES, seed=3)
    hidden = torch.randn(len(x), CHANNELS)
    nodes = SurvivingNodes(len(x))
    out = first(hidden, edge_index, batch=batch)
    nodes.pooled("first", first, out, hidden)
    again = second(out[0], out[1], batch=out[3])
    nodes.pooled("second", second, again, out[0])
    assert torch.equal(nodes.ids, out[4][again[4]])
    with pytest.raises(CaptureError, match="'third' .* called on 15 nodes"):
        nodes.pooled("third", second, second(hidden, edge_index, batch=batch), hidden)
