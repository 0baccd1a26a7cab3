"""A small Graphormer trained on the motifs task (:mod:`.graphs`: BA-2Motifs generated
offline, house vs five-cycle), on the same graphs and seeds as the built-in TransformerConv
(:mod:`.train`), and its training command.

Node features: :mod:`.graphs` gives each node a one-hot (capped) degree; Graphormer
embeds categories, so a node's feature is the index of its hot entry plus one, and 0 for an
all-zero row (a node masked by the node metrics, which zero its features). The flat PyG
batches of :mod:`.graphs` become Graphormer inputs through :func:`graphormer_inputs`,
and :func:`graphormer_forward` gives the node metrics' ``forward(x, edge_index, batch)``.

Retrain the shipped weights (about two minutes on one CPU thread)::

    OMP_NUM_THREADS=1 python -m captum_transformers.tasks.motifs.graphormer --out captum_transformers/assets

Example::

    >>> from captum_transformers.tasks.motifs.graphs import motif_graphs
    >>> model, data = load_motif_graphormer(), motif_graphs(8, seed=1)
    >>> logits = model(**graphormer_inputs(data.x, data.edge_index, data.batch)).logits    # (8, 2)
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from .graphs import motif_graphs
from .train import BATCH_GRAPHS, TEST_GRAPHS, TEST_SEED, TRAIN_GRAPHS

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "assets")
WEIGHTS, RECORD = "graphormer_motifs.pt", "graphormer_motifs.json"
#: The architecture of the shipped model (2 layers, as Ali et al.'s Graphormer experiments).
ARCHITECTURE = dict(num_classes=2, num_hidden_layers=2, embedding_dim=32, ffn_embedding_dim=32, num_attention_heads=4,
                    num_atoms=16, num_edges=8, num_in_degree=64, num_out_degree=64, num_spatial=512, num_edge_dis=8,
                    multi_hop_max_dist=5, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
COMMAND = "OMP_NUM_THREADS=1 python -m captum_transformers.tasks.motifs.graphormer --out captum_transformers/assets"


def node_categories(x: torch.Tensor) -> torch.Tensor:
    """(N, 1) long: the hot entry of each one-hot row plus one; 0 for an all-zero (masked) row."""
    weights = torch.arange(1, x.shape[1] + 1, dtype=x.dtype, device=x.device)
    return (x * weights).sum(-1, keepdim=True).round().long()


def graphormer_inputs(x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Collated Graphormer inputs (``input_nodes`` first) of a flat PyG batch, on ``x``'s device."""
    from ...models import GraphormerCollator

    categories, batch_cpu, edges_cpu = node_categories(x).cpu(), batch.cpu(), edge_index.cpu()
    graphs: List[Dict[str, torch.Tensor]] = []
    counts = torch.bincount(batch_cpu)
    starts = counts.cumsum(0) - counts
    for graph, (start, count) in enumerate(zip(starts.tolist(), counts.tolist())):
        edges = edges_cpu[:, batch_cpu[edges_cpu[0]] == graph] - start
        graphs.append({"x": categories[start:start + count], "edge_index": edges})
    collated = GraphormerCollator()(graphs)
    return {key: value.to(x.device) for key, value in collated.items()}


class GraphormerOnFlatBatches(nn.Module):
    """A Graphormer called as the task's PyG models are, ``forward(x, edge_index, batch) -> logits``:
    the node metrics' forward (masked nodes included) and the model PyG's fidelity runs. It is
    not what is explained: the methods explain the Graphormer itself (:func:`graphormer_arguments`)."""

    def __init__(self, graphormer: nn.Module) -> None:
        super().__init__()
        self.graphormer = graphormer
        # In the Graphormer's mode: PyG's Explainer restores the mode it found on this module,
        # which would otherwise put an eval-mode Graphormer into training mode.
        self.train(graphormer.training)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        return self.graphormer(**graphormer_inputs(x, edge_index, batch)).logits


def graphormer_forward(model) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """``forward(x, edge_index, batch) -> logits`` for the node metrics (masked nodes included)."""
    return GraphormerOnFlatBatches(model)


def graphormer_arguments(data, device) -> Dict[str, Dict[str, torch.Tensor]]:
    """The ``attribute`` arguments of one batch of the task's graphs (``tasks.motifs.evaluation``):
    the collated inputs as a mapping, ``input_nodes`` explained, giving (B, N_max) node scores."""
    return dict(inputs=graphormer_inputs(data.x.to(device), data.edge_index.to(device), data.batch.to(device)))


def _accuracy(model, data) -> float:
    with torch.no_grad():
        predicted = graphormer_forward(model)(data.x, data.edge_index, data.batch).argmax(-1)
    return float((predicted == data.labels).double().mean())


def train(epochs: int = 40, seed: int = 0, lr: float = 2e-3):
    """Train from scratch on :mod:`.train`' graphs; returns the model (eval mode) and its record."""
    from ...models import GraphormerConfig, GraphormerForGraphClassification

    started = time.time()
    data = motif_graphs(TRAIN_GRAPHS, seed=seed + 100)  # the TransformerConv's training graphs
    inputs, labels = graphormer_inputs(data.x, data.edge_index, data.batch), data.labels
    torch.manual_seed(seed)
    model = GraphormerForGraphClassification(GraphormerConfig(**ARCHITECTURE))
    optimiser = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        model.train()
        for index in torch.randperm(len(labels), generator=generator).split(BATCH_GRAPHS):
            loss = model(**{key: value[index] for key, value in inputs.items()}, labels=labels[index]).loss
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
    model.eval()
    seconds = time.time() - started
    record = {"task": "motifs (tasks.graph_motifs)", "seed": seed, "epochs": epochs, "batch_graphs": BATCH_GRAPHS,
              "lr": lr, "train_graphs": TRAIN_GRAPHS, "train_seed": seed + 100, "test_graphs": TEST_GRAPHS,
              "test_seed": TEST_SEED, "train_accuracy": _accuracy(model, data),
              "test_accuracy": _accuracy(model, motif_graphs(TEST_GRAPHS, seed=TEST_SEED)),
              "train_seconds": round(seconds, 1), "torch": torch.__version__, "command": COMMAND,
              "config": ARCHITECTURE}
    return model, record


def load_motif_graphormer(folder: Optional[str] = None):
    """The shipped motifs Graphormer (eval mode), built from its record's config."""
    from ...models import GraphormerConfig, GraphormerForGraphClassification

    folder = folder or ASSETS
    with open(os.path.join(folder, RECORD)) as handle:
        record = json.load(handle)
    model = GraphormerForGraphClassification(GraphormerConfig(**record["config"]))
    model.load_state_dict(torch.load(os.path.join(folder, WEIGHTS), map_location="cpu", weights_only=True))
    return model.eval()


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="Train the motifs Graphormer.")
    parser.add_argument("--out", default=ASSETS, help="folder for the weights and the record")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model, record = train(epochs=args.epochs, seed=args.seed)
    os.makedirs(args.out, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(args.out, WEIGHTS))
    with open(os.path.join(args.out, RECORD), "w") as handle:
        json.dump(record, handle, indent=1)
    print(json.dumps({k: v for k, v in record.items() if k != "config"}, indent=1))


if __name__ == "__main__":
    main()
