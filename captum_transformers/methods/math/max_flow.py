"""Maximum flow through the layered attention graph of Abnar & Zuidema (ACL 2020), exactly.

The graph has one node per (layer boundary, token): ``(L + 1) * n`` nodes for ``L`` attention
layers over ``n`` tokens. Node ``(l + 1, i)`` sends to ``(l, j)`` with capacity
``Ahat_l[i, j]``, the residual-corrected map of layer ``l``. Attention flow from output token
``i`` to input token ``j`` is the maximum flow from ``(L, i)`` to ``(0, j)``.

Dinic's algorithm (level graph by breadth-first search, then blocking flows by depth-first
search) on a dense residual matrix, in float64. Capacities are real numbers, so "exact" means
exact up to rounding: a residual capacity at or below ``tolerance`` (``1e-12`` of the largest
capacity) counts as saturated, which bounds the error by the number of edges times that
tolerance. No third-party graph library is needed.
"""
from __future__ import annotations

from typing import List, Sequence

import numpy as np


def layered_capacity(maps: Sequence[np.ndarray]) -> np.ndarray:
    """The dense capacity matrix ``(V, V)``, ``V = (L + 1) n``, of the attention graph of
    ``maps`` (``L`` matrices ``(n, n)`` in forward order). Node ``l * n + i`` is token ``i``
    at layer boundary ``l`` (0: the input tokens); ``maps[l][i, j]`` is the capacity of the
    edge from ``(l + 1, i)`` down to ``(l, j)``."""
    layers, tokens = len(maps), maps[0].shape[0]
    size = (layers + 1) * tokens
    capacity = np.zeros((size, size), dtype=np.float64)
    for layer, layer_map in enumerate(maps):
        upper, lower = (layer + 1) * tokens, layer * tokens
        capacity[upper:upper + tokens, lower:lower + tokens] = layer_map
    return capacity


def max_flow(capacity: np.ndarray, source: int, sink: int, tolerance: float = None) -> float:
    """The maximum flow value from ``source`` to ``sink`` in the directed graph whose edge
    ``u -> v`` has capacity ``capacity[u, v] >= 0`` (Dinic's algorithm).

    Example (two parallel paths of capacity 1 and 0.5, a bottleneck edge of 1.2)::

        >>> c = np.zeros((4, 4)); c[0, 1], c[0, 2], c[1, 3], c[2, 3] = 1.0, 0.5, 1.2, 1.0
        >>> max_flow(c, 0, 3)
        1.5
    """
    residual = np.array(capacity, dtype=np.float64, copy=True)
    if tolerance is None:
        tolerance = 1e-12 * max(float(residual.max(initial=0.0)), 1e-300)
    total = 0.0
    while True:
        level = _levels(residual, source, tolerance)
        if level[sink] < 0:
            return total
        total += _blocking_flow(residual, level, source, sink, tolerance)


def _levels(residual: np.ndarray, source: int, tolerance: float) -> np.ndarray:
    """Breadth-first distance from ``source`` over edges with residual capacity (-1: unreached)."""
    level = np.full(residual.shape[0], -1, dtype=np.int64)
    level[source] = 0
    frontier = np.array([source])
    depth = 0
    while frontier.size:
        depth += 1
        reached = (residual[frontier] > tolerance).any(axis=0) & (level < 0)
        frontier = np.flatnonzero(reached)
        level[frontier] = depth
    return level


def _blocking_flow(residual: np.ndarray, level: np.ndarray, source: int, sink: int, tolerance: float) -> float:
    """Push flow from ``source`` along the level graph until every path to ``sink`` is
    saturated. Depth-first, and each node forwards as much of what reaches it as it can
    before retreating (not one path from the source at a time), without recursion."""
    # Per node, its level-graph successors and a pointer to the next one to try (a saturated
    # edge or a dead end is skipped for good, which bounds the work per phase).
    successors: List[list] = [[] for _ in range(residual.shape[0])]
    for node in np.flatnonzero(level >= 0):
        successors[node] = np.flatnonzero((level == level[node] + 1) & (residual[node] > tolerance)).tolist()
    pointer = [0] * residual.shape[0]
    # Frames [node, what it may still forward, what it has forwarded].
    stack = [[source, float("inf"), 0.0]]
    returned = None  # what the frame just popped delivered to its parent
    while True:
        frame = stack[-1]
        node = frame[0]
        if returned is not None:  # the child at successors[node][pointer[node]] delivered `returned`
            child = successors[node][pointer[node]]
            if returned > 0.0:
                residual[node, child] -= returned
                residual[child, node] += returned
                frame[2] += returned
            if returned <= 0.0 or residual[node, child] <= tolerance:
                pointer[node] += 1
            returned = None
        if node == sink:
            returned = frame[1]
        else:
            options = successors[node]
            while pointer[node] < len(options) and residual[node, options[pointer[node]]] <= tolerance:
                pointer[node] += 1
            if frame[1] - frame[2] > tolerance and pointer[node] < len(options):
                child = options[pointer[node]]
                stack.append([child, min(frame[1] - frame[2], float(residual[node, child])), 0.0])
                continue
            returned = frame[2]
        stack.pop()
        if not stack:
            return returned
