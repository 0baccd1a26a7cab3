"""Graph batches no explanation can be read from, refused in the words of graphs: nodes,
edges and graphs, not tokens and examples.

* Node features holding NaN or inf: every map and relevance would be NaN; said as "the input
  holds NaN" (or inf), with the nodes that hold it.
* A sparse adjacency matrix (``torch.sparse`` COO/CSR/CSC, ``torch_sparse.SparseTensor``)
  where the model takes ``edge_index``: the attention layers' edges are read as a (2, E)
  ``edge_index``; PyG fuses message and aggregation on sparse matrices, so no per-edge
  ``alpha`` is formed. Refused before the forward, naming the argument and the conversion.
* A batch vector naming a graph that has no node (e.g. graphs 0, 1, 3): that graph has
  nothing to explain, and the methods' padding would see an empty example; node features
  holding no node at all.
* A list of targets that is not one class per graph (a graph-level model).

Example::

    >>> refuse_unexplainable_graphs(x, (edge_index, batch), None)
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ...errors import InputError
from .nodes import GraphBatch

_SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def _is_sparse(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.layout in _SPARSE_LAYOUTS
    cls = type(value)
    return cls.__name__ == "SparseTensor" and cls.__module__.startswith(("torch_sparse", "torch_geometric"))


def refuse_no_nodes(nodes: torch.Tensor) -> None:
    """:class:`InputError` for node features ``x`` holding no node."""
    if nodes.dim() >= 1 and nodes.shape[0] == 0:
        raise InputError(f"The node features x {tuple(nodes.shape)} hold no node, so the batch holds no graph to "
                         "explain. Call attribute() only on batches with at least one graph (skip empty batches).")


def refuse_graph_target_count(target: Any, graphs: GraphBatch) -> None:
    """:class:`InputError` when a list (or 1-D tensor) of targets does not name one class per
    graph of a graph-level model's batch."""
    if isinstance(target, list) or (isinstance(target, torch.Tensor) and target.dim() == 1):
        count = len(target)
        if count != graphs.num_graphs:
            raise InputError(
                f"target has {count} entries but the batch holds {graphs.num_graphs} graphs ({graphs.num_nodes} "
                "nodes); give one class per graph, in the order of the batch vector, or a single int for every "
                "graph.")


def refuse_non_finite_nodes(nodes: torch.Tensor) -> None:
    """:class:`InputError` when the node features ``x`` (N, F) hold NaN or inf."""
    if nodes.is_floating_point() and nodes.numel() and not bool(torch.isfinite(nodes).all()):
        nan = torch.isnan(nodes)
        what = "NaN" if bool(nan.any()) else "inf"
        bad = (nan if what == "NaN" else ~torch.isfinite(nodes)).reshape(nodes.shape[0], -1).any(dim=1)
        listed = bad.nonzero().flatten().tolist()
        raise InputError(
            f"The input holds {what}: the node features x {tuple(nodes.shape)} hold {what} at node(s) "
            f"{listed[:10]}{' ...' if len(listed) > 10 else ''} ({len(listed)} of {nodes.shape[0]} nodes), so every "
            "attention map and relevance would be NaN. Clean or impute those node features first.")


def refuse_sparse_adjacency(additional_forward_args: Sequence[Any], forward_kwargs: Optional[dict]) -> None:
    """:class:`InputError` naming a sparse adjacency matrix passed to the model."""
    named = [(f"additional_forward_args[{i}]", v) for i, v in enumerate(additional_forward_args)]
    named += [(f"forward_kwargs[{k!r}]", v) for k, v in (forward_kwargs or {}).items()]
    for where, value in named:
        if _is_sparse(value):
            kind = (f"a {value.layout} tensor" if isinstance(value, torch.Tensor)
                    else f"a {type(value).__module__}.{type(value).__name__}")
            raise InputError(
                f"{where} is a sparse adjacency matrix ({kind} of shape {tuple(value.size())}); the graph attention "
                "adapters read each layer's per-edge attention weights over an edge_index of shape (2, E) (on a "
                "sparse matrix PyG fuses the messages with their aggregation, and no per-edge weight is formed). "
                "Pass the edges as edge_index (2, E) of (source, target) node pairs instead: for a sparse adjacency "
                "adj with adj[source, target] set, edge_index = adj.to_sparse_coo().coalesce().indices() (repeated "
                "edges once; a transposed adj_t, as PyG's SparseTensor convention holds it, needs the two rows "
                "swapped: .flip(0)).")


def refuse_empty_graphs(graphs: GraphBatch) -> None:
    """:class:`InputError` naming the graphs of the batch that have no node."""
    empty = (graphs.counts == 0).nonzero().flatten().tolist()
    if empty:
        raise InputError(
            f"The batch vector numbers {graphs.num_graphs} graphs, but graph(s) {empty} have no node (no entry of "
            "batch names them), so they have no node to explain. Number the graphs of the batch 0, 1, ... without "
            "gaps (e.g. batch = torch.unique(batch, return_inverse=True)[1]), or remove the empty graphs.")


def refuse_unexplainable_graphs(nodes: torch.Tensor, additional_forward_args: Sequence[Any],
                                forward_kwargs: Optional[dict]) -> None:
    """The refusals above that need no batch vector, in the order an explanation meets them
    (:func:`refuse_empty_graphs` follows once the graphs are numbered)."""
    refuse_sparse_adjacency(additional_forward_args, forward_kwargs)
    refuse_no_nodes(nodes)
    refuse_non_finite_nodes(nodes)
