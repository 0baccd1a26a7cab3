"""Tiny PyG graph classifiers and graph batches for the pyg_* and graph_* tests (no downloads)."""
from __future__ import annotations

import torch
from torch import nn

import torch_geometric.nn as pyg

CHANNELS = 8
FEATURES = 3


def layer(kind: str, bias: bool = True) -> nn.Module:
    """One graph attention layer of ``kind`` with 2 heads, CHANNELS wide in and out."""
    if kind == "TransformerConv":
        return pyg.TransformerConv(CHANNELS, CHANNELS // 2, heads=2, bias=bias)
    if kind == "GATConv":
        return pyg.GATConv(CHANNELS, CHANNELS // 2, heads=2, bias=bias)
    if kind == "GATv2Conv":
        return pyg.GATv2Conv(CHANNELS, CHANNELS // 2, heads=2, bias=bias)
    raise ValueError(kind)


class GraphClassifier(nn.Module):
    """Node encoder, two graph attention layers, a mean pooling per graph, a linear head."""

    def __init__(self, kind: str, bias: bool = True, classes: int = 2):
        super().__init__()
        self.encode = nn.Linear(FEATURES, CHANNELS, bias=bias)
        self.convs = nn.ModuleList([layer(kind, bias), layer(kind, bias)])
        self.head = nn.Linear(CHANNELS, classes, bias=bias)

    def nodes(self, x, edge_index):
        hidden = self.encode(x)
        for conv in self.convs:
            hidden = conv(hidden, edge_index)
        return hidden

    def forward(self, x, edge_index, batch=None):
        return self.head(pyg.global_mean_pool(self.nodes(x, edge_index), batch))


class AddPoolClassifier(GraphClassifier):
    def forward(self, x, edge_index, batch=None):
        return self.head(pyg.global_add_pool(self.nodes(x, edge_index), batch))


class MaxPoolClassifier(GraphClassifier):
    def forward(self, x, edge_index, batch=None):
        return self.head(pyg.global_max_pool(self.nodes(x, edge_index), batch))


POOLS = {"mean": GraphClassifier, "add": AddPoolClassifier, "max": MaxPoolClassifier}


def graph_classifier(kind: str, seed: int = 0, pool: str = "mean", **options) -> GraphClassifier:
    torch.manual_seed(seed)
    return POOLS[pool](kind, **options).eval()


def graphs(sizes=(3, 5, 4), seed: int = 0):
    """A PyG batch of small random graphs: ``[(x, edge_index)]`` per graph and the batched
    ``(x, edge_index, batch)``; each graph is a ring plus one chord (every node has incoming edges)."""
    generator = torch.Generator().manual_seed(seed)
    singles = []
    for size in sizes:
        x = torch.randn(size, FEATURES, generator=generator)
        ring = torch.arange(size)
        source = torch.cat([ring, (ring + 1) % size, torch.tensor([0])])
        target = torch.cat([(ring + 1) % size, ring, torch.tensor([size // 2])])
        singles.append((x, torch.stack([source, target])))
    offsets = torch.tensor([0, *sizes]).cumsum(0)
    x = torch.cat([g[0] for g in singles])
    edge_index = torch.cat([g[1] + offsets[i] for i, g in enumerate(singles)], dim=1)
    batch = torch.cat([torch.full((size,), i) for i, size in enumerate(sizes)])
    return singles, (x, edge_index, batch)


class GPSClassifier(nn.Module):
    """Node encoder, two GPS layers (GIN local branch, global multi-head attention), mean pooling, head."""

    def __init__(self, local: bool = True, classes: int = 2, norm: str = "batch_norm"):
        super().__init__()
        self.encode = nn.Linear(FEATURES, CHANNELS)

        def gin():
            return pyg.GINConv(nn.Sequential(nn.Linear(CHANNELS, CHANNELS), nn.ReLU(), nn.Linear(CHANNELS, CHANNELS)))

        self.layers = nn.ModuleList([pyg.GPSConv(CHANNELS, gin() if local else None, heads=2, dropout=0.0,
                                                 norm=norm) for _ in range(2)])
        self.head = nn.Linear(CHANNELS, classes)

    def forward(self, x, edge_index, batch=None):
        hidden = self.encode(x)
        for layer in self.layers:
            hidden = layer(hidden, edge_index, batch)
        return self.head(pyg.global_mean_pool(hidden, batch))


def gps_classifier(seed: int = 0, **options) -> GPSClassifier:
    torch.manual_seed(seed)
    return GPSClassifier(**options).eval()
