r"""Edge relevance of sparse-attention graph layers: the relevance each edge's message carries.

A PyG attention layer sends one message per edge ``j -> i``, ``m_ij = alpha_ij v_j`` (E, H, C),
and sums them at the target, ``out_i = sum_j m_ij`` (plus a root or skip term where the layer
has one). Under a rule set (LRP as a modified gradient, ``R = x * g``), the relevance of the
message along edge ``e = (j -> i)`` is

.. math::  R_e = \sum_{h, c} m_{e,hc} \; \partial y / \partial m_{e,hc}

(Gradient x Input of the message, with the gradient following the rules). Conservation: the
sum is linear, so in every layer call ``sum_e R_e`` (self-loops the layer added included)
equals the relevance of the aggregated output ``sum_i out_i . dy/dout_i``. Under AH or AH+LN
(Ali et al., ICML 2022) on bias-free layers without a root term, every layer's edge relevance
of a graph sums to the explained logit (tests/test_graph_edges.py, float64, 1e-12).

Edges are reported against the user's ``edge_index``: a layer that adds self-loops (GATConv)
reports theirs in ``self_loops`` per node; repeated edges share their pair's relevance equally.

Example::

    >>> edges = edge_relevance(model, x, edge_index, batch=batch, target=labels)
    >>> edges.edges.shape, edges.edge_mask.shape        # (layers, E), (E,)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
from torch import nn

from ...adapters.graph.pyg_attention import PyGAttentionAdapter
from ...adapters.registry import get_adapter
from ...engine.runner import run_relevance
from ...errors import CaptureError, InputError
from ...propagation.rules.rule_set import RuleSet

VARIANTS = {"AH": RuleSet.AH, "AH+LN": RuleSet.AH_LN, "GI": RuleSet.GRADIENT, "AttnLRP": RuleSet.ATTN_LRP}


@dataclass(frozen=True)
class EdgeRelevance:
    """``edges`` (L, E): each attention call's message relevance along the user's edges;
    ``self_loops`` (L, N): along the self-loops the layer added; ``layers``: the calls' module
    names; ``nodes`` (N, F): relevance of the node features (x * gradient under the same rules);
    ``scores`` (B,): the relevance put on each graph's output."""

    edges: torch.Tensor
    self_loops: torch.Tensor
    layers: Tuple[str, ...]
    nodes: torch.Tensor
    scores: torch.Tensor

    @property
    def edge_mask(self) -> torch.Tensor:
        """(E,) the edges' relevance summed over the attention calls."""
        return self.edges.sum(0)


def on_user_edges(used: torch.Tensor, relevance: torch.Tensor, edge_index: torch.Tensor, num_nodes: int):
    """Relevance per edge the layer used (2, E') -> ``(per user edge (E,), per added self-loop (N,))``."""
    user_keys = edge_index[0] * num_nodes + edge_index[1]
    used_keys = used[0] * num_nodes + used[1]
    keys, inverse = torch.unique(torch.cat([user_keys, used_keys]), return_inverse=True)
    user_slot, used_slot = inverse[:user_keys.numel()], inverse[user_keys.numel():]
    per_pair = relevance.new_zeros(keys.numel()).index_add_(0, used_slot, relevance)
    multiplicity = torch.bincount(user_slot, minlength=keys.numel())
    on_edges = per_pair[user_slot] / multiplicity[user_slot].clamp(min=1).to(relevance.dtype)
    added = multiplicity[used_slot] == 0
    if bool((used[0][added] != used[1][added]).any()):
        raise CaptureError("A graph layer sent messages along edges that are not in edge_index and are not "
                           "self-loops; their relevance cannot be reported against the given edges.")
    loops = relevance.new_zeros(num_nodes).index_add_(0, used[0][added], relevance[added])
    return on_edges, loops


def edge_relevance(model: nn.Module, x: torch.Tensor, edge_index: torch.Tensor, batch: Optional[torch.Tensor] = None,
                   target: Any = None, rules: Any = "AH+LN", adapter=None, **forward_kwargs: Any) -> EdgeRelevance:
    """Message relevance along every edge (see the module docstring) of the model's graph
    attention layers, with the node relevance of the same pass. ``rules``: a
    :class:`RuleSet` or one of ``"AH"``, ``"AH+LN"`` (default), ``"GI"``, ``"AttnLRP"``."""
    if isinstance(rules, str):
        if rules not in VARIANTS:
            raise InputError(f"rules must be a RuleSet or one of {sorted(VARIANTS)}, got {rules!r}.")
        rules = VARIANTS[rules]
    adapter = get_adapter(model, adapter)
    if not isinstance(adapter, PyGAttentionAdapter):
        raise InputError(f"The {adapter.name} adapter reports no per-edge messages; edge relevance needs the "
                         "pyg_attention adapter (TransformerConv, GATConv, GATv2Conv).")
    if batch is not None:
        forward_kwargs = {**forward_kwargs, "batch": batch}
    messages: list = []
    result = run_relevance(adapter, model, (x,), (edge_index,), target, rules, "inputs", forward_kwargs,
                           messages=messages)
    if not messages:
        raise CaptureError("No graph attention layer sent messages in the forward pass.")
    mapped = [on_user_edges(used, relevance, edge_index, x.shape[0]) for _, used, relevance in messages]
    return EdgeRelevance(torch.stack([edges for edges, _ in mapped]), torch.stack([loops for _, loops in mapped]),
                         tuple(name for name, _, _ in messages), result.per_input[0], result.scores)
