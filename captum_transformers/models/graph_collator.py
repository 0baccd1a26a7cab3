"""Graphormer inputs from PyG-style graphs, in torch (no Cython): shortest paths by a batched
Floyd-Warshall, the edges along each path, degrees, and padding to the batch's largest graph.

Each graph is a ``torch_geometric.data.Data`` or a mapping with ``x`` (or ``node_feat``)
long (N, F), ``edge_index`` (2, E) and optionally ``edge_attr`` (or ``edge_feat``) long
(E, Fe), ``num_nodes`` and ``y`` (or ``labels``). Missing node or edge features become one
feature of value 1 per node / edge (as in 4.x). Edges are directed as given (PyG stores both directions
of an undirected edge).

The indices are exactly those transformers 4.x's ``preprocess_item`` + ``GraphormerDataCollator``
fed its Graphormer, so checkpoints trained there read the same embedding rows (0 is padding):

* ``input_nodes[n, f] = x[n, f] + 512 f + 3`` (4.x: a per-feature offset ``1 + 512 f``, then two
  shifts by one), ``attn_edge_type[i, j, f] = edge_attr[e, f] + 512 f + 2`` for the edge
  ``e = (i, j)``, 0 where there is none;
* ``spatial_pos = d(i, j) + 1``, with ``d = 510`` for unreachable pairs (4.x's value);
* ``in_degree = out_degree = `` (edges leaving the node) + 1, as 4.x computed both;
* ``input_edges[i, j, k] = attn_edge_type[p_k, p_{k+1}] + 1`` along the shortest path
  ``i = p_0, ..., p_d = j`` that Floyd-Warshall's last strict improvement records (4.x's
  path among ties), 0 beyond the path; the hop axis is as long as the batch's longest path
  (4.x made it 510 deep when a pair was unreachable: the model reads only the first
  ``multi_hop_max_dist`` hops and padding hops add 0, so its outputs are the same);
* ``attn_bias`` (B, N+1, N+1): 0, and ``-inf`` between nodes with ``spatial_pos >= spatial_pos_max``.

Example::

    >>> from torch_geometric.data import Data
    >>> graph = Data(x=torch.tensor([[0], [1], [1]]), edge_index=torch.tensor([[0, 1, 1, 2], [1, 0, 2, 1]]))
    >>> batch = GraphormerCollator()([graph, graph])
    >>> batch["spatial_pos"][0].tolist()
    [[1, 2, 3], [2, 1, 2], [3, 2, 1]]
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import torch

from ..errors import InputError

#: The distance 4.x's Floyd-Warshall gives unreachable pairs.
UNREACHABLE = 510
#: The per-feature offset of 4.x's ``convert_to_single_emb``.
FEATURE_OFFSET = 512


def _field(graph: Any, *names: str) -> Any:
    for name in names:
        value = graph.get(name) if isinstance(graph, Mapping) else getattr(graph, name, None)
        if value is not None:
            return value
    return None


def _long_matrix(value: Any, rows: int, what: str, index: int) -> torch.Tensor:
    if value is None:
        return torch.ones(rows, 1, dtype=torch.long)  # 4.x's "same embedding for all"
    tensor = torch.as_tensor(value)
    if tensor.is_floating_point() or tensor.is_complex():
        raise InputError(f"Graph {index}: {what} has dtype {tensor.dtype}; Graphormer embeds integer features "
                         "(categories). Pass long tensors (e.g. discretised features).")
    tensor = tensor.long().reshape(tensor.shape[0], -1) if tensor.dim() != 2 else tensor.long()
    if tensor.shape[0] != rows:
        raise InputError(f"Graph {index}: {what} has {tensor.shape[0]} rows, expected {rows}.")
    if tensor.numel() and (tensor.min() < 0 or tensor.max() >= FEATURE_OFFSET):
        raise InputError(f"Graph {index}: {what} holds values outside [0, {FEATURE_OFFSET}) "
                         f"(min {int(tensor.min())}, max {int(tensor.max())}); each feature gets "
                         f"{FEATURE_OFFSET} embedding rows.")
    return tensor


def _offsets(features: torch.Tensor) -> torch.Tensor:
    return features + FEATURE_OFFSET * torch.arange(features.shape[1], dtype=torch.long)


def shortest_paths(adjacency: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Batched Floyd-Warshall over (B, N, N) boolean adjacency: distances (unreachable:
    :data:`UNREACHABLE`) and, per pair, the intermediate node of its last strict improvement
    (-1: a direct edge or the node itself), the order 4.x's Cython loop visits."""
    batch, n, _ = adjacency.shape
    distance = torch.full((batch, n, n), UNREACHABLE, dtype=torch.long)
    distance[adjacency] = 1
    distance.diagonal(dim1=1, dim2=2).fill_(0)
    via = torch.full((batch, n, n), -1, dtype=torch.long)
    for k in range(n):
        # Row and column k do not change while k is the intermediate node (d[k, k] = 0).
        through = distance[:, :, k, None] + distance[:, None, k, :]
        shorter = through < distance
        distance = torch.where(shorter, through, distance)
        via = torch.where(shorter, torch.full_like(via, k), via)
    return distance.clamp(max=UNREACHABLE), via


def path_nodes(via: torch.Tensor, distance: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The node sequence of every reachable pair ``i != j``: ``(pairs (M, 3) as (graph, i, j),
    nodes (M, L) padded with -1, lengths (M,))``, expanded from ``via`` the way 4.x's
    recursion does (``path(i, j) = path(i, k) + [k] + path(k, j)``), one level per round."""
    pairs = ((distance > 0) & (distance < UNREACHABLE)).nonzero()
    width = int(distance[distance < UNREACHABLE].max()) + 1 if pairs.numel() else 2
    nodes = torch.full((pairs.shape[0], width), -1, dtype=torch.long)
    nodes[:, 0], nodes[:, 1] = pairs[:, 1], pairs[:, 2]
    lengths = torch.full((pairs.shape[0],), 2, dtype=torch.long)
    graph = pairs[:, :1]
    positions = torch.arange(width - 1)
    while pairs.numel():
        segment = positions[None, :] < (lengths[:, None] - 1)
        left, right = nodes[:, :-1].clamp(min=0), nodes[:, 1:].clamp(min=0)
        middle = via[graph.expand_as(left), left, right]
        inserted = segment & (middle >= 0)
        if not inserted.any():
            break
        before = torch.cumsum(inserted.long(), dim=1)  # insertions in segments 0..p
        # Node p moves right by the insertions in segments before it; a segment's middle
        # node lands just after the segment's left node.
        shift = torch.cat([torch.zeros_like(before[:, :1]), before], dim=1)
        target = torch.arange(width)[None, :] + shift
        expanded = torch.full_like(nodes, -1)
        keep = torch.arange(width)[None, :] < lengths[:, None]
        rows = torch.arange(nodes.shape[0])[:, None].expand_as(nodes)
        expanded[rows[keep], target[keep]] = nodes[keep]
        middle_target = target[:, :-1] + 1
        expanded[rows[:, :-1][inserted], middle_target[inserted]] = middle[inserted]
        nodes, lengths = expanded, lengths + inserted.sum(dim=1)
    return pairs, nodes, lengths


class GraphormerCollator:
    """Collate graphs into Graphormer's padded inputs (see the module docstring).

    ``spatial_pos_max``: pairs at ``spatial_pos >= spatial_pos_max`` get ``-inf`` in
    ``attn_bias`` (4.x's collator default 20; None: never). Returns a dict with
    ``input_nodes``, ``input_edges``, ``attn_bias``, ``in_degree``, ``out_degree``,
    ``spatial_pos``, ``attn_edge_type`` and, when every graph has one, ``labels``.
    """

    def __init__(self, spatial_pos_max: Optional[int] = 20):
        self.spatial_pos_max = spatial_pos_max

    def __call__(self, graphs: Sequence[Any]) -> Dict[str, torch.Tensor]:
        graphs = list(graphs)
        if not graphs:
            raise InputError("GraphormerCollator got no graph; pass a non-empty list.")
        nodes, edges, indices, sizes = [], [], [], []
        for index, graph in enumerate(graphs):
            edge_index = _field(graph, "edge_index")
            if edge_index is None:
                raise InputError(f"Graph {index} has no edge_index (2, E).")
            edge_index = torch.as_tensor(edge_index).long()
            features = _field(graph, "x", "node_feat")
            count = _field(graph, "num_nodes")
            count = int(count) if count is not None else (len(features) if features is not None else None)
            if count is None or count == 0:
                raise InputError(f"Graph {index} has no nodes (give x, node_feat or num_nodes > 0).")
            if edge_index.dim() != 2 or edge_index.shape[0] != 2 or \
                    (edge_index.numel() and (edge_index.min() < 0 or edge_index.max() >= count)):
                raise InputError(f"Graph {index}: edge_index must be (2, E) with node indices in [0, {count}); "
                                 f"got shape {tuple(edge_index.shape)}.")
            nodes.append(_long_matrix(features, count, "x", index))
            edges.append(_long_matrix(_field(graph, "edge_attr", "edge_feat"), edge_index.shape[1], "edge_attr", index))
            indices.append(edge_index)
            sizes.append(count)
        if len({n.shape[1] for n in nodes}) != 1 or len({e.shape[1] for e in edges}) != 1:
            raise InputError("Every graph of a batch needs the same number of node features and of edge features; "
                             f"got {sorted({n.shape[1] for n in nodes})} and {sorted({e.shape[1] for e in edges})}.")
        batch, width = len(graphs), max(sizes)
        adjacency = torch.zeros(batch, width, width, dtype=torch.bool)
        input_nodes = torch.zeros(batch, width, nodes[0].shape[1], dtype=torch.long)
        attn_edge_type = torch.zeros(batch, width, width, edges[0].shape[1], dtype=torch.long)
        real = torch.zeros(batch, width, dtype=torch.bool)
        for b, (x, e, edge_index, count) in enumerate(zip(nodes, edges, indices, sizes)):
            input_nodes[b, :count] = _offsets(x) + 3
            adjacency[b, edge_index[0], edge_index[1]] = True
            attn_edge_type[b, edge_index[0], edge_index[1]] = _offsets(e) + 2
            real[b, :count] = True
        distance, via = shortest_paths(adjacency)
        pair_real = real[:, :, None] & real[:, None, :]
        spatial_pos = torch.where(pair_real, distance + 1, torch.zeros_like(distance))
        degree = torch.where(real, adjacency.sum(dim=-1) + 1, torch.zeros(batch, width, dtype=torch.long))
        attn_bias = torch.zeros(batch, width + 1, width + 1)
        if self.spatial_pos_max is not None:
            far = pair_real & (spatial_pos >= self.spatial_pos_max)
            attn_bias[:, 1:, 1:] = attn_bias[:, 1:, 1:].masked_fill(far, float("-inf"))
        input_edges = self._path_edges(distance, via, pair_real, attn_edge_type)
        out = {"input_nodes": input_nodes, "input_edges": input_edges, "attn_bias": attn_bias,
               "in_degree": degree, "out_degree": degree.clone(), "spatial_pos": spatial_pos,
               "attn_edge_type": attn_edge_type}
        labels = [_field(graph, "y", "labels") for graph in graphs]
        if all(label is not None for label in labels):
            labels = [torch.as_tensor(label) for label in labels]
            out["labels"] = (torch.cat([label.reshape(-1) for label in labels])
                             if all(label.numel() == 1 for label in labels) else torch.stack(labels))
        return out

    @staticmethod
    def _path_edges(distance: torch.Tensor, via: torch.Tensor, pair_real: torch.Tensor,
                    attn_edge_type: torch.Tensor) -> torch.Tensor:
        batch, width = distance.shape[:2]
        distance = torch.where(pair_real, distance, torch.zeros_like(distance))
        pairs, nodes, lengths = path_nodes(via, distance)
        hops = max(nodes.shape[1] - 1, 1)
        input_edges = torch.zeros(batch, width, width, hops, attn_edge_type.shape[-1], dtype=torch.long)
        if not pairs.numel():
            return input_edges
        hop = torch.arange(nodes.shape[1] - 1)[None, :].expand(pairs.shape[0], -1)
        on_path = hop < (lengths[:, None] - 1)
        row = torch.arange(pairs.shape[0])[:, None].expand_as(hop)[on_path]
        graph, source, target = pairs[row, 0], pairs[row, 1], pairs[row, 2]
        start, end = nodes[:, :-1][on_path], nodes[:, 1:][on_path]
        input_edges[graph, source, target, hop[on_path]] = attn_edge_type[graph, start, end] + 1
        return input_edges


__all__ = ["GraphormerCollator", "shortest_paths", "path_nodes", "UNREACHABLE", "FEATURE_OFFSET"]
