"""``captum-transformers explain --motifs N``: the built-in BA-2Motifs model explained on N
test graphs by every method that applies to it, drawn as graphs with nodes coloured by score.

One row per graph, one column per method; the motif's nodes are drawn with a black ring.
Signed relevance is red (positive) to blue (negative), centred at 0; attention maps from
light to dark. The layout of each graph is fixed (networkx spring layout, seed 0) so the
columns of a row can be compared.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Sequence

import torch

from ..adapters.graph.nodes import GraphBatch
from ..errors import InputError
from ..methods.catalog import SIGNED_METHODS, build_method
from ..visualization.output import agg_figure

# The catalog methods the motif model's TransformerConv layers support (docs/graphs.md).
GRAPH_METHODS = ("raw-attention", "rollout", "grad-cam", "generic-attention", "gradient-x-input",
                 "conservative-lrp-ah", "conservative-lrp", "attn-lrp", "partial-lrp", "lrp")


def graph_grid(data, scores: Dict[str, torch.Tensor], titles: Sequence[str], path: Path) -> Path:
    """Draw each graph of ``data`` once per method, nodes coloured by ``scores[method]`` (N,)."""
    try:
        import networkx as nx
    except ImportError:
        raise InputError("drawing graphs needs networkx: pip install 'captum_transformers[graph]'.") from None
    rows, cols = data.num_graphs, len(scores)
    figure = agg_figure(2.0 * cols, 2.0 * rows)  # its own canvas: the session's pyplot is left alone
    axes = figure.subplots(rows, cols, squeeze=False)
    for row in range(rows):
        nodes = (data.batch == row).nonzero().flatten()
        first = int(nodes[0])
        edges = data.edge_index[:, (data.batch[data.edge_index[0]] == row)] - first
        graph = nx.Graph()
        graph.add_nodes_from(range(len(nodes)))
        graph.add_edges_from(edges.t().tolist())
        layout = nx.spring_layout(graph, seed=0)
        truth = data.node_truth[nodes].tolist()
        for col, (name, values) in enumerate(scores.items()):
            axis = axes[row][col]
            node_values = values[nodes].numpy()
            signed = name in SIGNED_METHODS  # by the method, never guessed from this graph's values
            limit = float(values[nodes].abs().max()) or 1.0
            nx.draw_networkx_edges(graph, layout, ax=axis, width=0.6, edge_color="#999999")
            nx.draw_networkx_nodes(graph, layout, ax=axis, node_size=60, node_color=node_values,
                                   cmap="bwr" if signed else "Reds", vmin=-limit if signed else 0.0, vmax=limit,
                                   edgecolors=["black" if t else "none" for t in truth], linewidths=1.2)
            axis.set_axis_off()
            if row == 0:
                axis.set_title(f"{name}\n{'red for, blue against' if signed else 'unsigned: darker = more'}",
                               fontsize=7)
        axes[row][0].text(0.0, 1.02, titles[row], transform=axes[row][0].transAxes, fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return path


def explain_motifs(count: int, methods: Sequence[str], target, out: Path) -> Path:
    """Explain ``count`` test graphs of the motifs task; returns the PNG path."""
    from ..tasks.motifs.graphs import CLASSES, motif_graphs
    from ..tasks.motifs.model import load_motif_model
    from ..tasks.motifs.train import TEST_SEED

    if count < 1:
        raise InputError(f"--motifs {count}: expected at least 1 graph.")
    unsupported = [name for name in methods if name not in GRAPH_METHODS]
    if unsupported:
        raise InputError(f"{', '.join(unsupported)} do not apply to the motif model's PyG layers "
                         f"(docs/graphs.md); use {', '.join(GRAPH_METHODS)}.")
    if target is not None and target not in range(len(CLASSES)):
        raise InputError(f"--target {target} is out of range: the motif model has classes 0 (house) and 1 (cycle).")
    data, model = motif_graphs(count, seed=TEST_SEED), load_motif_model()
    with torch.no_grad():
        probabilities = model(data.x, data.edge_index, data.batch).softmax(-1)
    predicted = probabilities.argmax(-1)
    explained = predicted if target is None else torch.full_like(predicted, target)
    titles = [f"pred {CLASSES[int(p)]} ({float(probabilities[i, p]):.2f}), true {CLASSES[int(data.labels[i])]}"
              for i, p in enumerate(predicted)]
    graphs = GraphBatch.of(data.batch, data.x.shape[0])
    scores = {}
    for name in methods:
        tokens = build_method(name, model).attribute(data.x, target=explained, return_tokens=True,
                                                     additional_forward_args=(data.edge_index, data.batch))
        scores[name] = tokens.detach().float()[graphs.graph, graphs.position]
        print(f"  {name:>22}: done")
    return graph_grid(data, scores, titles, out / "explanations.png")
