"""MIF / LIF curves and SRG over the nodes of graphs (Blücher et al., TMLR 2024, applied to
nodes). Graphs are fed as in :mod:`node_perturbation`: ``forward(x, edge_index, batch)``
returns logits (G, C); see :mod:`relevance_gain` for the curve math.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from .node_perturbation import GraphForward, check_graph_batch, dense_per_graph, masked_logits
from ..relevance_gain import GAIN_FRACTIONS, RelevanceGain, removal_masks
from ..validation import require_choice

NODE_REMOVALS = ("drop", "zero")
"""``"drop"``: features zeroed and edges removed (as ``NodeActivation``); ``"zero"``: features zeroed, edges kept."""


class GraphRelevanceGain(RelevanceGain):
    """MIF and LIF curves of the explained class's score as nodes are removed; SRG.

    Step ``x_t`` removes the ``ceil(x_t * n)`` most (MIF) or least (LIF) relevant of a
    graph's ``n`` nodes: ``removal="drop"`` (default) zeroes their features and removes
    their edges (a removed node sends and receives no message), ``"zero"`` only zeroes
    their features. ``batch`` must number the graphs 0..G-1 without gaps. Every step of every graph of the batch is one graph of a single forward call.

    Example::

        metric = GraphRelevanceGain(lambda x, edge_index, batch: model(x, edge_index, batch))
        metric.update(x, edge_index, batch, node_scores, labels)     # node_scores (N,), labels (G,)
        metric.compute().srg
    """

    name = "srg_graphs"

    def __init__(self, forward: GraphForward, removal: str = "drop", fractions: Sequence[float] = GAIN_FRACTIONS,
                 score: str = "prob") -> None:
        super().__init__(fractions, score)
        require_choice("removal", removal, NODE_REMOVALS)
        self.forward = forward
        self.removal = removal

    def update(self, x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor, scores: torch.Tensor,
               labels: torch.Tensor) -> None:
        """Add a batch of graphs: x (N, F), edge_index (2, E), batch (N,), node scores (N,), labels (G,)."""
        num_graphs = check_graph_batch(x, edge_index, batch, scores, labels)
        cpu_batch = batch.cpu()
        key, position = dense_per_graph(scores.detach().to(torch.float64).cpu(), cpu_batch, num_graphs, -math.inf)
        removed = removal_masks(key, torch.isfinite(key), self.fractions)  # (2T, G, N_max)
        kept = ~removed[:, cpu_batch, position].to(x.device)  # (2T, N)
        logits = masked_logits(self.forward, x, edge_index, batch, kept, keep_edges=self.removal == "zero",
                               labels=labels)
        self._record(logits, labels)
