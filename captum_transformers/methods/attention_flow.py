"""Attention flow (Abnar & Zuidema, ACL 2020): maximum flow through the attention graph."""
from __future__ import annotations

import numpy as np
import torch

from .. import functional
from ..capture.trace import AttentionTrace, CaptureSpec
from ..errors import InputError
from .base import TraceAttribution
from .math.max_flow import layered_capacity, max_flow

#: Largest graph solved, in nodes ``(layers + 1) * tokens`` per example. Measured CPU time
#: (one thread) per explained row, random row-stochastic maps: 51 nodes (2 layers, 17 tokens)
#: 0.01 s; 325 (4 x 65) 0.63 s; 650 (12 x 50) 1.3 s; 1014 (12 x 78) 3.7 s. The built-in
#: DigitCanvas ViT's maps (325 nodes) take 1.2 s: sharper maps take more augmenting paths.
MAX_GRAPH_NODES = 1024


class AttentionFlow(TraceAttribution):
    r"""Attention flow: the maximum flow from the explained token to each input token.

    .. math:: \hat A^{(l)} = \mathrm{rownorm}(I + \mathbb{E}_h[A^{(l)}]), \qquad
              R_j = \frac{\mathrm{maxflow}\big((L, q) \to (0, j)\big)}
                         {\sum_{j'} \mathrm{maxflow}\big((L, q) \to (0, j')\big)}

    Abnar & Zuidema, "Quantifying Attention Flow in Transformers" (ACL 2020), the "A-Flow"
    baseline of Ali et al. (ICML 2022). The layers form a graph with one node per (layer
    boundary, token); node ``(l + 1, i)`` sends to ``(l, j)`` with capacity
    ``\hat A^{(l)}_{ij}`` (heads averaged, the residual added, rows normalised, as in the
    authors' code). Each explained token's flows are normalised to sum to 1, as the authors
    normalise them; several explained rows are mixed with their weights. Padding is left out
    of the graph (it scores 0). Class-agnostic; one forward pass, no backward.

    Exact: Dinic's maximum-flow algorithm (:mod:`~captum_transformers.methods.math.max_flow`) in
    float64, one flow per (explained row, token), on the CPU. That is costly, so graphs above
    ``max_graph_nodes`` nodes (``(layers + 1) * tokens``, default 1024; 3.7 s of CPU per
    explained row at 1014 nodes, 1.2 s per DigitCanvas image) are refused; :class:`AttentionRollout` is the fast approximation the
    same paper proposes. One token sequence attending to itself only.

    Example::

        >>> flow = AttentionFlow(bert).attribute(input_ids, forward_kwargs={"attention_mask": mask},
        ...                                      return_tokens=True)      # (B, S), rows sum to 1
    """

    class_specific = False  # no gradient: target does not change the map
    run_by_default = False  # exact maximum flows cost seconds per example: run only when named

    def __init__(self, model, adapter=None, max_graph_nodes: int = MAX_GRAPH_NODES) -> None:
        if isinstance(max_graph_nodes, bool) or not isinstance(max_graph_nodes, int) or max_graph_nodes < 2:
            raise InputError(f"max_graph_nodes must be an integer >= 2, got {max_graph_nodes!r}.")
        super().__init__(model, adapter)
        self.max_graph_nodes = max_graph_nodes

    def capture_spec(self) -> CaptureSpec:
        return CaptureSpec(forward_reduce=lambda probs: functional.fuse_heads(probs, "mean"))

    def reduce(self, trace: AttentionTrace):
        if not self.is_one_sequence(trace):
            raise InputError(
                "AttentionFlow is defined for one token sequence attending to itself (Abnar & Zuidema's graph); this "
                f"model mixes several streams ({sorted(trace.streams.layouts)}). Use AttentionRollout or "
                "GenericAttention, which follow the ICCV'21 rules between streams.")
        maps = [record.forward_value for record in trace.records]
        batch, tokens = maps[0].shape[0], maps[0].shape[-1]
        mask = trace.layout.token_mask
        real = mask.to(torch.bool) if mask is not None else torch.ones(batch, tokens, dtype=torch.bool)
        largest = (len(maps) + 1) * int(real.sum(dim=1).max())
        if largest > self.max_graph_nodes:
            raise InputError(
                f"AttentionFlow solves exact maximum flows on a graph of (layers + 1) x tokens nodes: here "
                f"({len(maps)} + 1) x {int(real.sum(dim=1).max())} = {largest} nodes, above max_graph_nodes="
                f"{self.max_graph_nodes} (cost grows faster than the square of the nodes; 3.7 s of CPU per "
                "explained row at 1014 nodes). Use fewer tokens, raise max_graph_nodes knowingly, or use AttentionRollout, the fast "
                "approximation of the same paper.")
        start = self.start_rows(trace, torch.float64).cpu().numpy()
        fused = [m.detach().to(device="cpu", dtype=torch.float64).numpy() for m in maps]
        scores = np.zeros((batch, tokens), dtype=np.float64)
        for example in range(batch):
            kept = real[example].cpu().numpy().nonzero()[0]
            scores[example, kept] = _flow_row([m[example][np.ix_(kept, kept)] for m in fused], start[example, kept])
        return torch.from_numpy(scores).to(device=maps[0].device, dtype=maps[0].dtype)


def _flow_row(maps, row_weights: np.ndarray) -> np.ndarray:
    """The weighted mix of the normalised flows of the explained rows (``row_weights > 0``)
    to every input token, over the real tokens' graph of one example."""
    tokens = maps[0].shape[0]
    eye = np.eye(tokens)
    corrected = [(m + eye) / (m + eye).sum(axis=-1, keepdims=True) for m in maps]
    capacity = layered_capacity(corrected)
    top = len(maps) * tokens
    mixed = np.zeros(tokens)
    for row in np.flatnonzero(row_weights):
        flows = np.array([max_flow(capacity, top + row, sink) for sink in range(tokens)])
        mixed += row_weights[row] * flows / flows.sum()
    return mixed
