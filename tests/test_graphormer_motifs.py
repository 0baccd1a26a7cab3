"""The shipped motifs Graphormer: its weights give the accuracy their training record states on
the motifs task's test graphs, and the flat PyG batches of the task become Graphormer inputs."""
from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torch_geometric")

from captum_transformers.tasks import graphormer_motifs as task  # noqa: E402
from captum_transformers.tasks.graph_motifs import motif_graphs  # noqa: E402


def test_shipped_weights_reproduce_their_record():
    with open(os.path.join(task.ASSETS, task.RECORD)) as handle:
        record = json.load(handle)
    assert os.path.getsize(os.path.join(task.ASSETS, task.WEIGHTS)) < 1_000_000
    model = task.load_motif_graphormer()
    data = motif_graphs(record["test_graphs"], seed=record["test_seed"])
    with torch.no_grad():
        predicted = task.graphormer_forward(model)(data.x, data.edge_index, data.batch).argmax(-1)
    assert float((predicted == data.labels).double().mean()) == record["test_accuracy"] >= 0.95


def test_flat_batches_become_graphormer_inputs_graph_by_graph():
    data = motif_graphs(3, seed=5)
    inputs = task.graphormer_inputs(data.x, data.edge_index, data.batch)
    for graph in range(3):
        part = data.graphs(graph, graph + 1)
        alone = task.graphormer_inputs(part.x, part.edge_index, part.batch)
        n = part.x.shape[0]
        assert torch.equal(inputs["input_nodes"][graph, :n], alone["input_nodes"][0])
        assert torch.equal(inputs["spatial_pos"][graph, :n, :n], alone["spatial_pos"][0])
        # Categories: the one-hot degree's index + 1 (+3 for the embedding rows), 0 for a masked row.
        assert torch.equal(alone["input_nodes"][0, :, 0], part.x.argmax(-1) + 4)
    masked = task.node_categories(torch.zeros(2, 6))
    assert masked.tolist() == [[0], [0]]
