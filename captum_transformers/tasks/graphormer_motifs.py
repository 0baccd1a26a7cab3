"""A small Graphormer trained on BA-2Motifs (house vs five-cycle), generated offline, and
its training command.

The graphs are PyG's ``ExplainerDataset`` recipe that ``BA2MotifDataset``'s docstring gives
for the downloaded set: a 25-node Barabasi-Albert graph (one edge per new node) with one
house (class 0) or one five-node cycle (class 1) attached, 500 graphs each, the motif's nodes
marked as ground truth. Generation is seeded (torch, ``random``, numpy) and reproducible.
Nodes carry no features (one constant feature, value 0, as 4.x's collator gives featureless
graphs): the model sees only degrees and the shortest-path and edge encodings.

Retrain the shipped weights (about a minute on one CPU thread)::

    OMP_NUM_THREADS=1 python -m captum_transformers.tasks.graphormer_motifs --out captum_transformers/assets

Example::

    >>> from captum_transformers.tasks.graphormer_motifs import load_motif_graphormer, motif_graphs
    >>> model = load_motif_graphormer()
    >>> graphs = motif_graphs()[-5:]       # dicts with x, edge_index, y, node_mask
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Dict, List, Optional, Tuple

import torch

ASSETS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets")
WEIGHTS, RECORD = "graphormer_ba2motifs.pt", "graphormer_ba2motifs.json"
CLASSES = ("house", "cycle")
#: The architecture of the shipped model (2 layers, as Ali et al.'s graph experiments).
ARCHITECTURE = dict(num_classes=2, num_hidden_layers=2, embedding_dim=32, ffn_embedding_dim=32, num_attention_heads=4,
                    num_atoms=8, num_edges=8, num_in_degree=64, num_out_degree=64, num_spatial=512, num_edge_dis=8,
                    multi_hop_max_dist=5, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)


def motif_graphs(per_class: int = 500, seed: int = 0) -> List[Dict[str, torch.Tensor]]:
    """BA-2Motifs graphs: dicts with ``x`` (30, 1) zeros, ``edge_index``, ``y`` (the class,
    house 0 / cycle 1) and ``node_mask`` (True on the motif's five nodes). Houses first."""
    import numpy as np
    from torch_geometric.datasets import ExplainerDataset
    from torch_geometric.datasets.graph_generator import BAGraph
    from torch_geometric.datasets.motif_generator import CycleMotif, HouseMotif

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    graphs = []
    for label, motif in enumerate((HouseMotif(), CycleMotif(5))):
        dataset = ExplainerDataset(graph_generator=BAGraph(num_nodes=25, num_edges=1), motif_generator=motif,
                                   num_motifs=1, num_graphs=per_class)
        for data in dataset:
            graphs.append({"x": torch.zeros(data.num_nodes, 1, dtype=torch.long), "edge_index": data.edge_index,
                           "y": torch.tensor([label]), "node_mask": data.node_mask.bool()})
    return graphs


def split(graphs: List[Dict[str, torch.Tensor]], seed: int = 0, test_share: float = 0.2):
    """A seeded shuffle into (train, test)."""
    order = torch.randperm(len(graphs), generator=torch.Generator().manual_seed(seed)).tolist()
    cut = int(round(len(graphs) * (1 - test_share)))
    return [graphs[i] for i in order[:cut]], [graphs[i] for i in order[cut:]]


def collate(graphs: List[Dict[str, torch.Tensor]]) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
    """Graphormer inputs (by name, ``input_nodes`` included) and the labels."""
    from ..models import GraphormerCollator

    batch = GraphormerCollator()([{k: v for k, v in g.items() if k != "node_mask"} for g in graphs])
    return batch, batch.pop("labels")


def _rows(batch: Dict[str, torch.Tensor], index: torch.Tensor) -> Dict[str, torch.Tensor]:
    return {key: value[index] for key, value in batch.items()}


def accuracy(model, batch: Dict[str, torch.Tensor], labels: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(**batch).logits.argmax(-1) == labels).double().mean().item()


def train(epochs: int = 40, seed: int = 0, batch_size: int = 32, lr: float = 2e-3):
    """Train from scratch; returns the model (eval mode) and the training record."""
    from ..models import GraphormerConfig, GraphormerForGraphClassification

    started = time.time()
    train_graphs, test_graphs = split(motif_graphs(seed=seed), seed=seed)
    train_batch, train_labels = collate(train_graphs)
    test_batch, test_labels = collate(test_graphs)
    torch.manual_seed(seed)
    model = GraphormerForGraphClassification(GraphormerConfig(**ARCHITECTURE))
    optimiser = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        model.train()
        for index in torch.randperm(len(train_labels), generator=generator).split(batch_size):
            loss = model(**_rows(train_batch, index), labels=train_labels[index]).loss
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
    model.eval()
    record = {"task": "BA-2Motifs (ExplainerDataset, 500 house + 500 cycle, seed %d)" % seed, "seed": seed,
              "epochs": epochs, "batch_size": batch_size, "lr": lr, "train_graphs": len(train_graphs),
              "test_graphs": len(test_graphs), "train_accuracy": accuracy(model, train_batch, train_labels),
              "test_accuracy": accuracy(model, test_batch, test_labels),
              "seconds": round(time.time() - started, 1), "torch": torch.__version__,
              "command": "OMP_NUM_THREADS=1 python -m captum_transformers.tasks.graphormer_motifs "
                         "--out captum_transformers/assets", "config": ARCHITECTURE}
    return model, record


def load_motif_graphormer(folder: Optional[str] = None):
    """The shipped BA-2Motifs Graphormer (eval mode), built from its record's config."""
    from ..models import GraphormerConfig, GraphormerForGraphClassification

    folder = folder or ASSETS
    with open(os.path.join(folder, RECORD)) as handle:
        record = json.load(handle)
    model = GraphormerForGraphClassification(GraphormerConfig(**record["config"]))
    model.load_state_dict(torch.load(os.path.join(folder, WEIGHTS), map_location="cpu", weights_only=True))
    return model.eval()


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="Train the BA-2Motifs Graphormer.")
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
