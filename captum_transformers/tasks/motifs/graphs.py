"""BA-2Motifs, generated offline: Barabasi-Albert graphs with a house or a 5-cycle attached.

Each graph is a 20-node Barabasi-Albert tree (``BAGraph(num_nodes=20, num_edges=1)``) with
one motif of 5 nodes joined to a random node by one edge, as in PyG's ``ExplainerDataset``
(which generates it: ``BA2MotifDataset`` itself downloads); class 0 holds a house
(``HouseMotif``), class 1 a 5-cycle (``CycleMotif(5)``). The ground truth is the motif's
nodes and edges. Node features are the one-hot degree, capped at ``MAX_DEGREE``: with the
same features at every node, an attention layer computes the same value at every node (a
weighted mean of equal values) and could not see the motif at all.

The two-motif variant (``two_motifs=True``) attaches a house *and* a 5-cycle to every base
graph, for class specificity: a map explaining "house" should put its positive relevance on
the house, not on the cycle. Generation is reproducible only with torch, ``random`` and numpy
seeded together; :func:`motif_graphs` seeds all three and restores their states.

Example::

    >>> data = motif_graphs(8, seed=0)
    >>> data.x.shape, data.labels.tolist()[:4], int(data.node_truth.sum())
    (torch.Size([200, 6]), [0, 1, 0, 1], 40)
"""
from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from typing import Iterator, List

import numpy as np
import torch

BASE_NODES = 20
MOTIF_NODES = 5
MAX_DEGREE = 5
FEATURES = MAX_DEGREE + 1
CLASSES = ("house", "cycle")


@dataclass(frozen=True)
class MotifGraphs:
    """A batch of motif graphs in PyG's flat form, with their ground truth.

    ``x`` (N, FEATURES), ``edge_index`` (2, E), ``batch`` (N,), ``labels`` (G,) (0 house, 1
    cycle; for two-motif graphs the class of ``first_motif``), ``node_truth`` (N,) True on
    motif nodes, ``edge_truth`` (E,) True on motif edges, ``motif`` (N,) -1 on base nodes,
    else the class of the motif holding the node.
    """

    x: torch.Tensor
    edge_index: torch.Tensor
    batch: torch.Tensor
    labels: torch.Tensor
    node_truth: torch.Tensor
    edge_truth: torch.Tensor
    motif: torch.Tensor

    @property
    def num_graphs(self) -> int:
        return int(self.labels.shape[0])

    def __len__(self) -> int:
        return self.num_graphs

    def graphs(self, start: int, stop: int) -> "MotifGraphs":
        """Graphs ``start:stop`` as a batch of their own (nodes and edges renumbered)."""
        nodes = (self.batch >= start) & (self.batch < stop)
        first = int(nodes.nonzero()[0]) if bool(nodes.any()) else 0
        edges = nodes[self.edge_index[0]]
        return MotifGraphs(self.x[nodes], self.edge_index[:, edges] - first, self.batch[nodes] - start,
                           self.labels[start:stop], self.node_truth[nodes], self.edge_truth[edges], self.motif[nodes])


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """torch, random and numpy seeded together (BAGraph draws from numpy through networkx-free
    code, the motif joins from torch); their states are restored afterwards."""
    torch_state, random_state, numpy_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        random.setstate(random_state)
        np.random.set_state(numpy_state)


def _one_hot_degree(edge_index: torch.Tensor, num_nodes: int) -> torch.Tensor:
    degree = torch.bincount(edge_index[1], minlength=num_nodes).clamp(max=MAX_DEGREE)
    return torch.nn.functional.one_hot(degree, FEATURES).float()


def _generate(motifs, num_graphs: int):
    from torch_geometric.datasets import ExplainerDataset
    from torch_geometric.datasets.graph_generator import BAGraph
    from torch_geometric.datasets.motif_generator import MotifGenerator

    class Alternating(MotifGenerator):
        """The given motifs in turn: with num_motifs=len(motifs), one of each per graph."""

        def __init__(self):
            super().__init__()
            self.calls = 0

        def __call__(self):
            motif = motifs[self.calls % len(motifs)]()
            self.calls += 1
            return motif

    dataset = ExplainerDataset(graph_generator=BAGraph(num_nodes=BASE_NODES, num_edges=1),
                               motif_generator=Alternating(), num_motifs=len(motifs), num_graphs=num_graphs)
    return [dataset[i] for i in range(num_graphs)]


def motif_graphs(num_graphs: int, seed: int = 0, two_motifs: bool = False) -> MotifGraphs:
    """``num_graphs`` BA-2Motifs graphs, classes alternating (house, cycle, house, ...);
    with ``two_motifs`` every graph holds a house and a cycle (``labels`` alternate which one
    was attached first, so both motif positions occur)."""
    from torch_geometric.datasets.motif_generator import CycleMotif, HouseMotif

    kinds = {0: HouseMotif(), 1: CycleMotif(MOTIF_NODES)}
    xs: List[torch.Tensor] = []
    edges, batches, node_truth, edge_truth, motif_of = [], [], [], [], []
    labels = torch.arange(num_graphs) % 2
    offset = 0
    with _seeded(seed):
        for index, label in enumerate(labels.tolist()):
            order = [label, 1 - label] if two_motifs else [label]
            (graph,) = _generate([kinds[k] for k in order], 1)
            num_nodes = int(graph.num_nodes)
            xs.append(_one_hot_degree(graph.edge_index, num_nodes))
            edges.append(graph.edge_index + offset)
            batches.append(torch.full((num_nodes,), index))
            node_truth.append(graph.node_mask.bool())
            edge_truth.append(graph.edge_mask.bool())
            kind = torch.full((num_nodes,), -1)
            for slot, k in enumerate(order):
                kind[BASE_NODES + slot * MOTIF_NODES: BASE_NODES + (slot + 1) * MOTIF_NODES] = k
            motif_of.append(kind)
            offset += num_nodes
    return MotifGraphs(torch.cat(xs), torch.cat(edges, dim=1), torch.cat(batches), labels, torch.cat(node_truth),
                       torch.cat(edge_truth), torch.cat(motif_of))
