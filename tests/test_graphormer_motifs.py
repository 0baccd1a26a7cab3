"""The shipped motifs Graphormer: its weights give the accuracy their training record states on
the motifs task's test graphs, and the flat PyG batches of the task become Graphormer inputs."""
from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torch_geometric")

from captum_transformers.tasks.motifs import graphormer as task
from captum_transformers.tasks.motifs.graphs import motif_graphs  # noqa: E402


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


def test_benchmark_task_runs_the_graphormer_from_the_command_line(tmp_path, capsys):
    from captum_transformers.cli import main
    from captum_transformers.evaluation.graphs.node_perturbation import NodeAUROC
    from captum_transformers.methods.catalog import build_method
    from captum_transformers.tasks.runner import run_benchmark

    methods = ["rollout", "conservative-lrp", "transformer-relevance"]  # the last is refused on TransformerConv
    assert main(["benchmark", "--task", "motifs-graphormer", "--methods", *methods, "--limit", "4",
                 "--batch-size", "2", "--no-progress", "--out", str(tmp_path / "run")]) == 0
    printed = capsys.readouterr().out
    assert "task motifs-graphormer: 4 test examples, 3 methods" in printed and "| transformer-relevance |" in printed
    assert (tmp_path / "run" / "results.json").stat().st_size > 0
    # The runner's node scores are the Graphormer's own (B, N_max) node scores in the flat batch's order.
    report = run_benchmark("motifs-graphormer", methods=["conservative-lrp"], limit=4, batch_size=2)
    data = motif_graphs(4, seed=1)
    model = task.load_motif_graphormer()
    expected = NodeAUROC()
    for start in (0, 2):
        part = data.graphs(start, start + 2)
        inputs = task.graphormer_inputs(part.x, part.edge_index, part.batch)
        tokens = build_method("conservative-lrp", model).attribute(inputs, target=part.labels, return_tokens=True)
        expected.update(tokens[inputs["input_nodes"][:, :, 0] != 0].double(), part.node_truth, part.batch)
    assert report.result("conservative-lrp", "node_auroc").value == expected.compute().value
