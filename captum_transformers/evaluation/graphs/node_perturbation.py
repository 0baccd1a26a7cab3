"""Node metrics of graph explanations: activation (AUAC) and pruning (AU-MSE) over nodes (Ali
et al., ICML 2022, Sec. 6.2, after Schnake et al.), and the AUROC of node scores against
ground-truth nodes.

A *masked* node has its features set to zero and its edges removed: it sends and receives no
message, so revealing a node brings back both its features and its edges to revealed
neighbours (an edge is present when both its ends are). Every step of every graph is one
graph of a single batched forward call.

* :class:`NodeActivation`: start from every node masked and reveal the ``ceil(f n)`` most
  relevant nodes; ``curve(f)`` = mean p(true class), AUAC = trapezoid over ``f`` (higher is better).
* :class:`NodePruning`: mask the ``ceil(f n)`` nodes of lowest absolute relevance;
  ``curve(f)`` = mean squared logit change from the unmasked graph, AU-MSE (lower is better).
* :class:`NodeAUROC`: per graph, the probability that a ground-truth node outscores another
  node (ties count half), averaged over graphs (float64 exact sums; no torchmetrics).

Example::

    >>> metric = NodeActivation(lambda x, edge_index, batch: model(x, edge_index, batch))
    >>> metric.update(x, edge_index, batch, node_scores, labels)     # node_scores (N,)
    >>> metric.compute().auc
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

from ...errors import InputError
from ..accumulator import Accumulator, exact_sum
from ..curves import mean_curve
from ..results import CurveResult, ScalarResult
from ..tokens.token_flipping import TOKEN_FRACTIONS, flip_counts, ranks
from ..validation import require_finite, require_fractions, require_labels_in_range, require_nonempty_batch

GraphForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def dense_per_graph(values: torch.Tensor, batch: torch.Tensor, num_graphs: int, fill: float) -> torch.Tensor:
    """Per-node values (N,) as (G, N_max) rows, ``fill`` at padding; and the node positions."""
    counts = torch.bincount(batch, minlength=num_graphs)
    starts = counts.cumsum(0) - counts
    order = torch.sort(batch, stable=True).indices
    position = torch.empty_like(batch)
    position[order] = torch.arange(batch.numel()) - starts[batch[order]]
    out = torch.full((num_graphs, int(counts.max())), fill, dtype=values.dtype)
    out[batch, position] = values
    return out, position


def check_graph_batch(x, edge_index, batch, scores, labels=None):
    """The number of graphs G of a node-level batch, after checking its shapes: x (N, F),
    edge_index (2, E), batch (N,) numbering the graphs 0..G-1 without gaps, finite node scores
    (N,) and, if given, labels (G,). Raises ``InputError`` saying what to fix."""
    if x.dim() != 2 or edge_index.dim() != 2 or edge_index.shape[0] != 2 or batch.shape != (x.shape[0],):
        raise InputError(f"expected x (N, F), edge_index (2, E) and batch (N,); got {tuple(x.shape)}, "
                         f"{tuple(edge_index.shape)} and {tuple(batch.shape)}.")
    if scores.shape != (x.shape[0],):
        raise InputError(f"node scores must be (N,) = ({x.shape[0]},), one per node; got {tuple(scores.shape)}.")
    require_finite("node scores", scores)
    require_nonempty_batch(batch.numel())
    counts = torch.bincount(batch.cpu())
    if bool((counts == 0).any()):
        missing = (counts == 0).nonzero().flatten().tolist()
        raise InputError(f"batch skips graph ids {missing[:5]}: it must number the graphs 0..G-1 without gaps (as "
                         "torch_geometric's Batch does), or every missing id counts as a graph without nodes. "
                         "Renumber it, e.g. torch.unique(batch, return_inverse=True)[1].")
    num_graphs = counts.numel()
    if labels is not None and labels.shape != (num_graphs,):
        raise InputError(f"labels must be one per graph ({num_graphs},); got {tuple(labels.shape)}.")
    return num_graphs


def masked_logits(forward: GraphForward, x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor,
                  kept: torch.Tensor, keep_edges: bool = False, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Logits (T, G, C) of the graphs with only the nodes ``kept[t]`` (T, N) unmasked, one call.

    A masked node has its features zeroed and, unless ``keep_edges``, its edges removed.
    ``labels`` (G,), when given, are checked against the number of classes returned.
    """
    steps, num_nodes = kept.shape
    num_graphs = int(batch.max()) + 1
    xs = torch.cat([x * kept[t, :, None].to(x.dtype) for t in range(steps)])
    edges = [(edge_index if keep_edges else edge_index[:, kept[t][edge_index[0]] & kept[t][edge_index[1]]])
             + t * num_nodes for t in range(steps)]
    batches = torch.cat([batch + t * num_graphs for t in range(steps)])
    with torch.no_grad():
        logits = forward(xs, torch.cat(edges, dim=1), batches)
    if labels is not None:
        require_labels_in_range(labels, logits.shape[-1])
    return logits.reshape(steps, num_graphs, -1).to(torch.float64)


class _NodeCurve(Accumulator):
    def __init__(self, forward: GraphForward, fractions: Sequence[float]) -> None:
        super().__init__()
        self.forward = forward
        self.fractions = require_fractions(fractions, 0.0, 1.0)
        self._add_state("sums", (len(self.fractions),), exact=True)
        self._add_state("count")

    def _kept(self, scores, batch, num_graphs, descending: bool, reveal: bool):
        key, position = dense_per_graph(scores.detach().to(torch.float64).cpu(), batch.cpu(), num_graphs,
                               -math.inf if descending else math.inf)
        real = torch.isfinite(key)
        order = ranks(key, descending=descending)  # (G, N_max)
        counts = flip_counts(self.fractions, real)  # (T, G)
        node_rank = order[batch.cpu(), position]  # (N,)
        chosen = node_rank[None, :] < counts[:, batch.cpu()]  # (T, N): among the first ceil(f n)
        return (chosen if reveal else ~chosen).to(batch.device)


class NodeActivation(_NodeCurve):
    """Activation curve and AUAC over nodes (see the module docstring)."""

    def __init__(self, forward: GraphForward, fractions: Sequence[float] = TOKEN_FRACTIONS) -> None:
        super().__init__(forward, fractions)

    def update(self, x, edge_index, batch, scores, labels) -> None:
        """Add a batch of graphs: x (N, F), edge_index (2, E), batch (N,), node scores (N,), labels (G,)."""
        num_graphs = check_graph_batch(x, edge_index, batch, scores, labels)
        kept = self._kept(scores, batch, num_graphs, descending=True, reveal=True)
        logits = masked_logits(self.forward, x, edge_index, batch, kept, labels=labels)
        probability = torch.softmax(logits, -1).gather(
            2, labels.to(logits.device)[None, :, None].expand(len(self.fractions), -1, 1)).squeeze(2)
        self._add("sums", exact_sum(probability.cpu(), dim=1))
        self._add("count", torch.tensor(num_graphs))

    def compute(self) -> CurveResult:
        return mean_curve("auac", self.fractions, self._value("sums"), self._state["count"], higher_is_better=True,
                          y_label="p(true class)", x_label="fraction of nodes revealed")


class NodePruning(_NodeCurve):
    """Pruning curve and AU-MSE over nodes (see the module docstring)."""

    def __init__(self, forward: GraphForward, fractions: Sequence[float] = TOKEN_FRACTIONS) -> None:
        super().__init__(forward, fractions)
        if self.fractions[0] != 0.0:
            raise InputError(f"fractions must start at 0.0 (the unpruned reference logits), got {self.fractions}.")

    def update(self, x, edge_index, batch, scores, labels=None) -> None:
        """Add a batch of graphs: x (N, F), edge_index (2, E), batch (N,), node scores (N,)."""
        num_graphs = check_graph_batch(x, edge_index, batch, scores)
        kept = self._kept(scores.abs(), batch, num_graphs, descending=False, reveal=False)
        logits = masked_logits(self.forward, x, edge_index, batch, kept)
        squared_error = ((logits - logits[:1]) ** 2).sum(-1)
        self._add("sums", exact_sum(squared_error.cpu(), dim=1))
        self._add("count", torch.tensor(num_graphs))

    def compute(self) -> CurveResult:
        return mean_curve("au_mse", self.fractions, self._value("sums"), self._state["count"],
                          higher_is_better=False, y_label="squared logit error", x_label="fraction of nodes pruned")


def graph_auroc(scores: torch.Tensor, truth: torch.Tensor) -> float:
    """P(score of a true node > score of another node), ties half, for one graph (nan if one class is empty)."""
    positive, negative = scores[truth], scores[~truth]
    if positive.numel() == 0 or negative.numel() == 0:
        return math.nan
    above = (positive[:, None] > negative[None, :]).double().sum()
    ties = (positive[:, None] == negative[None, :]).double().sum()
    return float((above + 0.5 * ties) / (positive.numel() * negative.numel()))


class NodeAUROC(Accumulator):
    """Mean over graphs of the AUROC of node scores against ground-truth nodes (higher is better;
    a constant map scores 0.5). Graphs whose truth holds no node or every node are excluded."""

    def __init__(self) -> None:
        super().__init__()
        self._add_state("auroc_sum", exact=True)
        self._add_state("count")

    def update(self, scores: torch.Tensor, truth: torch.Tensor, batch: torch.Tensor) -> None:
        """Add a batch: node scores (N,), ground truth (N,) bool, batch (N,)."""
        if scores.shape != truth.shape or scores.shape != batch.shape or scores.dim() != 1:
            raise InputError(f"scores, truth and batch must all be (N,); got {tuple(scores.shape)}, "
                             f"{tuple(truth.shape)} and {tuple(batch.shape)}.")
        scores = scores.detach().to(torch.float64).cpu()
        require_finite("node scores", scores)
        values = [graph_auroc(scores[batch.cpu() == g], truth.cpu().bool()[batch.cpu() == g])
                  for g in range(int(batch.max()) + 1)]
        defined = torch.tensor([v for v in values if not math.isnan(v)], dtype=torch.float64)
        self._add("auroc_sum", exact_sum(defined))
        self._add("count", torch.tensor(defined.numel()))

    def compute(self) -> ScalarResult:
        count = int(self._state["count"].item())
        return ScalarResult(name="node_auroc", value=float(self._value("auroc_sum")) / count if count else math.nan,
                            count=count)
