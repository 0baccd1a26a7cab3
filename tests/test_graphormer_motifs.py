"""The shipped BA-2Motifs Graphormer: the data regenerate offline, and the weights give the
accuracy their training record states."""
from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torch_geometric")

from captum_transformers.tasks import graphormer_motifs as task  # noqa: E402


def test_shipped_weights_reproduce_their_record():
    with open(os.path.join(task.ASSETS, task.RECORD)) as handle:
        record = json.load(handle)
    assert os.path.getsize(os.path.join(task.ASSETS, task.WEIGHTS)) < 1_000_000
    graphs = task.motif_graphs(seed=record["seed"])
    assert len(graphs) == 1000 and [int(g["y"]) for g in graphs].count(0) == 500
    assert all(int(g["node_mask"].sum()) == 5 and g["x"].shape == (30, 1) for g in graphs)
    train, test = task.split(graphs, seed=record["seed"])
    assert (len(train), len(test)) == (record["train_graphs"], record["test_graphs"])
    model = task.load_motif_graphormer()
    batch, labels = task.collate(test)
    assert task.accuracy(model, batch, labels) == record["test_accuracy"] >= 0.95
    # Explained per graph: node scores for the motif nodes and the rest, padding-free batch.
    from captum_transformers import ConservativeLRP

    nodes = batch.pop("input_nodes")
    tokens = ConservativeLRP(model).attribute(nodes[:4], target=labels[:4], return_tokens=True,
                                              forward_kwargs={k: v[:4] for k, v in batch.items()})
    assert tokens.shape == (4, 31) and torch.isfinite(tokens).all()
