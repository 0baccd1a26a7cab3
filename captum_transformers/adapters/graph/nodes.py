"""The graphs of a PyG batch: which graph each node belongs to, its position there, and the
per-graph dense maps built from per-edge values.

A PyG batch is one flat node list ``x`` (N, F) with a ``batch`` vector (N,) naming each
node's graph (``None``: one graph); ``edge_index`` (2, E) holds (source, target) pairs that
never cross graphs, so the batch's adjacency is block-diagonal. The package's methods chain
(B, H, N_max, N_max) maps, one block per graph, padded to the largest graph: row ``i`` of a
map is target node ``i`` attending to its sources, so a softmax over incoming edges makes
each real row sum to 1 (a row-stochastic "target attends to source" map); padded rows and
columns are 0.

Example::

    >>> graph = GraphBatch.of(torch.tensor([0, 0, 1, 1, 1]))
    >>> graph.num_graphs, graph.max_nodes, graph.position.tolist()
    (2, 3, [0, 1, 0, 1, 2])
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn

from ...errors import CaptureError, InputError


@dataclass(frozen=True)
class GraphBatch:
    """``graph`` (N,) and ``position`` (N,) of every node, ``counts`` (B,) nodes per graph."""

    graph: torch.Tensor
    position: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def of(cls, batch: Optional[torch.Tensor], num_nodes: Optional[int] = None) -> "GraphBatch":
        """From PyG's ``batch`` vector (or ``None`` and ``num_nodes``: one graph)."""
        if batch is None:
            batch = torch.zeros(num_nodes, dtype=torch.long)
        if batch.dim() != 1 or batch.dtype not in (torch.long, torch.int, torch.int32, torch.int64):
            raise InputError(f"batch must be a 1-D integer vector naming each node's graph, got {batch.dtype} of "
                             f"shape {tuple(batch.shape)}.")
        if num_nodes is not None and batch.shape[0] != num_nodes:
            raise InputError(f"batch names the graph of {batch.shape[0]} nodes but x has {num_nodes} nodes.")
        batch = batch.long()
        if batch.numel() and int(batch.min()) < 0:
            raise InputError("batch holds a negative graph index; PyG numbers graphs 0, 1, ...")
        num_graphs = int(batch.max()) + 1 if batch.numel() else 0
        counts = torch.bincount(batch, minlength=num_graphs)
        order = torch.sort(batch, stable=True).indices
        starts = torch.cumsum(counts, 0) - counts
        position = torch.empty_like(batch)
        position[order] = torch.arange(batch.numel(), device=batch.device) - starts[batch[order]]
        return cls(batch, position, counts)

    @property
    def num_graphs(self) -> int:
        return int(self.counts.shape[0])

    @property
    def max_nodes(self) -> int:
        return int(self.counts.max()) if self.counts.numel() else 0

    @property
    def num_nodes(self) -> int:
        return int(self.graph.shape[0])

    def node_mask(self) -> torch.Tensor:
        """(B, N_max) True at real nodes."""
        return torch.arange(self.max_nodes, device=self.counts.device)[None, :] < self.counts[:, None]

    def dense_nodes(self, values: torch.Tensor) -> torch.Tensor:
        """Per-node values (N,) as (B, N_max), 0 at padding."""
        out = values.new_zeros(self.num_graphs, self.max_nodes)
        out[self.graph, self.position] = values
        return out

    def dense_nodes_of(self, rows: torch.Tensor) -> torch.Tensor:
        """Per-node rows (N, ...) as (B, N_max, ...), 0 at padding."""
        out = rows.new_zeros(self.num_graphs, self.max_nodes, *rows.shape[1:])
        out[self.graph, self.position] = rows
        return out

    def edge_places(self, edge_index: torch.Tensor, flow: str):
        """(graph, target position, source position) of every edge, refused if an edge joins
        two graphs (the batch would not be block-diagonal)."""
        source, target = edge_index if flow == "source_to_target" else edge_index.flip(0)
        graph = self.graph[target]
        if not torch.equal(graph, self.graph[source]):
            raise InputError("edge_index joins nodes of different graphs of the batch; each graph's edges must stay "
                             "inside it (check that edge_index and batch come from the same PyG Batch).")
        return graph, self.position[target], self.position[source]

    def dense_edges(self, places, values: torch.Tensor, accumulate: bool = True) -> torch.Tensor:
        """Per-edge values (E, H) as (B, H, N_max, N_max) maps, ``[b, h, target, source]``.
        Repeated edges add up (``accumulate``) or, for gradients, which are equal on repeated
        edges of a softmax map, are written once."""
        graph, target, source = places
        size = self.max_nodes
        dense = values.new_zeros(self.num_graphs, size, size, values.shape[1])
        dense.index_put_((graph, target, source), values, accumulate=accumulate)
        return dense.permute(0, 3, 1, 2).contiguous()  # heads first, as the methods reduce them


def batch_argument(model: nn.Module, args: Sequence[Any], kwargs: Optional[dict], name: str) -> Optional[torch.Tensor]:
    """The value the model's forward receives as ``name`` (PyG's ``batch``), or None when the
    forward has no such parameter or it is not given (one graph)."""
    kwargs = dict(kwargs or {})
    if name in kwargs:
        return kwargs[name]
    forward = getattr(model, "_orig_mod", model).forward  # a torch.compile-d model: the original's signature
    parameters = inspect.signature(forward).parameters
    if name not in parameters and any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters.values()):
        raise InputError(f"{type(model).__name__}.forward takes *args, so which argument is PyG's batch vector is "
                         f"not known; pass it by keyword (forward_kwargs={{{name!r}: batch}}) or give the adapter "
                         "batch_argument=.")
    try:
        bound = inspect.signature(forward).bind_partial(*args, **kwargs)
    except TypeError as error:
        raise InputError(f"The arguments do not fit {type(model).__name__}.forward ({error}); pass the node features "
                         "as inputs and (edge_index, batch) as additional_forward_args.") from error
    value = bound.arguments.get(name)
    if value is not None and not isinstance(value, torch.Tensor):
        raise CaptureError(f"The model's {name!r} argument is a {type(value).__name__}, not PyG's batch vector; "
                           "pass PyGAttentionAdapter(batch_argument=...) naming the argument that holds it.")
    return value
