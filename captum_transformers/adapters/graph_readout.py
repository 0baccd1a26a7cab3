"""Which nodes a graph model's output reads: the graph readout, or the explained node.

Graph-level models pool each graph's nodes; the explained rows of the attention maps are the
nodes the pooling reads, each with weight ``1 / n`` for a mean or add pooling. The pooling is
found in the model's forward source (``global_mean_pool``, ``global_add_pool``, PyG's
``MeanAggregation`` / ``SumAggregation`` modules) or given by the user; a max, sort or
attention pooling, or a source naming none or several, is refused.

Node-level models return one row of scores per node; each graph of the batch explains one of
its nodes, named with its class as a ``(node, class)`` target pair (``node`` indexes the flat
node list ``x``), so examples stay graphs: two explained nodes of one graph would share one
backward pass. Their explained row is that node.

Example::

    >>> detected_readouts(model)             # a forward calling global_mean_pool
    ['mean']
    >>> node_targets(GraphBatch.of(batch), [(3, 1), (9, 0)])   # node 3 of graph 0, node 9 of graph 1
    [(3, 1), (2, 0)]
"""
from __future__ import annotations

import functools
import inspect
import re
from typing import Any, List, Optional

import torch
from torch import nn

from ..errors import CaptureError, InputError
from .graph_nodes import GraphBatch

READOUTS = ("mean", "add", "node")
# Readouts seen in a model's source: name -> the readout it is.
_POOLINGS = {"global_mean_pool": "mean", "global_add_pool": "add", "global_max_pool": "max",
             "MeanAggregation": "mean", "SumAggregation": "add", "MaxAggregation": "max",
             "AttentionalAggregation": "attention", "SetTransformerAggregation": "attention",
             "SortAggregation": "sort", "global_sort_pool": "sort"}
_POOLING_PATTERN = re.compile(r"\b(" + "|".join(_POOLINGS) + r")\b")


def detected_readouts(model: nn.Module) -> List[str]:
    """The poolings named in the forward source of ``model`` and of its non-library
    submodules, and PyG aggregation modules it holds (sorted, unique)."""
    found = set()
    # A message-passing layer's own aggregation (its "aggr") is not a readout.
    layer_aggregations = {id(getattr(m, "aggr_module", None)) for m in model.modules()}
    for module in model.modules():
        cls = type(module)
        if cls.__name__ in _POOLINGS and id(module) not in layer_aggregations:
            found.add(_POOLINGS[cls.__name__])
        if not cls.__module__.startswith(("torch.", "torch_geometric.")):
            found.update(_source_poolings(cls))
    return sorted(found)


@functools.lru_cache(maxsize=256)
def _source_poolings(cls: type) -> frozenset:
    """The poolings named in ``cls.forward``'s source (read once per class)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return frozenset()
    return frozenset(_POOLINGS[name] for name in _POOLING_PATTERN.findall(source))


def graph_readout(model: nn.Module, given: Optional[str]) -> str:
    """The graph-level readout: ``given`` ("mean" or "add"), else the one the source names."""
    if given in ("mean", "add"):
        return given
    found = detected_readouts(model)
    if len(found) == 1 and found[0] in ("mean", "add"):
        return found[0]
    seen = f"found {found}" if found else "found no global_*_pool call or PyG aggregation module"
    raise CaptureError(
        f"The attention maps of a graph model are read at the nodes its readout pools, but the readout of "
        f"{type(model).__name__} is not known ({seen} in its forward source). For a mean or add pooling pass "
        "adapter=PyGAttentionAdapter(readout='mean') (or 'add'); max, sort and attention poolings read nodes "
        "unequally and are not supported by the attention methods (ConservativeLRP needs no readout)."
    )


def node_targets(graphs: GraphBatch, target: Any) -> List[tuple]:
    """``(position in its graph, class)`` per graph from ``(node, class)`` pairs, one per graph
    in graph order (a single pair for one graph, a list of pairs, or a (G, 2) tensor)."""
    hint = ("A node-level model explains one node per graph: pass target=[(node, class), ...] with one pair per "
            f"graph of the batch ({graphs.num_graphs}), in graph order, node indexing x.")
    if target is None:
        raise InputError(f"The model returns one row per node; which node to explain is not known. {hint}")
    if isinstance(target, torch.Tensor):
        if target.dim() != 2 or target.shape[1] != 2 or target.is_floating_point():
            raise InputError(f"target tensor of shape {tuple(target.shape)}: expected (G, 2) integer pairs. {hint}")
        target = [tuple(pair) for pair in target.tolist()]
    elif isinstance(target, tuple) and len(target) == 2 and all(isinstance(v, int) for v in target):
        target = [target]
    if not isinstance(target, (list, tuple)) or not all(
            isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(v, int) and not isinstance(v, bool)
                                                                       for v in pair) for pair in target):
        raise InputError(f"target={target!r} is not a list of (node, class) pairs. {hint}")
    if len(target) != graphs.num_graphs:
        raise InputError(f"{len(target)} (node, class) pairs for {graphs.num_graphs} graphs. {hint}")
    local = []
    for graph, (node, cls) in enumerate(target):
        if not 0 <= node < graphs.num_nodes or int(graphs.graph[node]) != graph:
            raise InputError(f"target pair {graph} names node {node}, which is not a node of graph {graph}. {hint}")
        local.append((int(graphs.position[node]), cls))
    return local
