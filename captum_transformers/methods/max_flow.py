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
    """Push flow along shortest augmenting paths until none is left in the level graph."""
    # Per node, its level-graph successors and a pointer to the next one to try (dead ends are
    # skipped for good, which bounds the work per phase).
    successors: List[np.ndarray] = [np.empty(0, dtype=np.int64)] * residual.shape[0]
    for node in np.flatnonzero(level >= 0):
        successors[node] = np.flatnonzero((level == level[node] + 1) & (residual[node] > tolerance))
    pointer = np.zeros(residual.shape[0], dtype=np.int64)
    pushed = 0.0
    while True:
        path = [source]
        while path[-1] != sink:
            node = path[-1]
            options = successors[node]
            while pointer[node] < options.size and residual[node, options[pointer[node]]] <= tolerance:
                pointer[node] += 1
            if pointer[node] == options.size:  # dead end: retreat and never come back here
                if node == source:
                    return pushed
                path.pop()
                pointer[path[-1]] += 1
                continue
            path.append(int(options[pointer[node]]))
        tails, heads = np.array(path[:-1]), np.array(path[1:])
        bottleneck = float(residual[tails, heads].min())
        residual[tails, heads] -= bottleneck
        residual[heads, tails] += bottleneck
        pushed += bottleneck
