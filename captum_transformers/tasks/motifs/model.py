"""The built-in BA-2Motifs classifier: a small PyG TransformerConv graph transformer.

Architecture (:class:`MotifTransformer`): a linear node encoder (one-hot degree -> 32), three
``TransformerConv(32, 16, heads=2)`` layers, each followed by a per-node ``nn.LayerNorm`` and a
ReLU, mean pooling per graph (``global_mean_pool``, the readout the pyg_attention adapter reads
from the source) and a linear head over the two classes (house, cycle).

The weights ship as ``captum_transformers/assets/motif_transformer.pt`` (float32 state dict)
next to ``motif_transformer.json`` (accuracies, seed, training time and the exact command of
:mod:`captum_transformers.tasks.motifs.train` that produced them).

Example::

    >>> from captum_transformers.tasks.motifs.graphs import motif_graphs
    >>> model, data = load_motif_model(), motif_graphs(4, seed=1)
    >>> model(data.x, data.edge_index, data.batch).shape
    torch.Size([4, 2])
"""
from __future__ import annotations

from typing import Any, Dict

import torch
from torch import nn

from .graphs import CLASSES, FEATURES
from ..shipped_weights import asset, load_shipped_record, load_shipped_weights

WEIGHTS_FILE = "motif_transformer.pt"
RECORD_FILE = "motif_transformer.json"
HIDDEN = 32
HEADS = 2
LAYERS = 3


class MotifTransformer(nn.Module):
    """Encoder, ``LAYERS`` x (TransformerConv, LayerNorm, ReLU), mean pooling, linear head."""

    def __init__(self) -> None:
        super().__init__()
        from torch_geometric.nn import TransformerConv

        self.encode = nn.Linear(FEATURES, HIDDEN)
        self.convs = nn.ModuleList([TransformerConv(HIDDEN, HIDDEN // HEADS, heads=HEADS) for _ in range(LAYERS)])
        self.norms = nn.ModuleList([nn.LayerNorm(HIDDEN) for _ in range(LAYERS)])
        self.head = nn.Linear(HIDDEN, len(CLASSES))

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor = None) -> torch.Tensor:
        from torch_geometric.nn import global_mean_pool

        hidden = self.encode(x)
        for conv, norm in zip(self.convs, self.norms):
            hidden = torch.relu(norm(conv(hidden, edge_index)))
        return self.head(global_mean_pool(hidden, batch))


def motif_model_record() -> Dict[str, Any]:
    """The JSON record of the shipped weights: test accuracies, seed, training time, command."""
    return load_shipped_record(RECORD_FILE, "The motif model record", "python -m captum_transformers.tasks.motifs.train")


def load_motif_model() -> MotifTransformer:
    """The shipped BA-2Motifs TransformerConv model in eval mode."""
    return load_shipped_weights(MotifTransformer(), asset(WEIGHTS_FILE), "The motif model weights",
                                "python -m captum_transformers.tasks.motifs.train")
