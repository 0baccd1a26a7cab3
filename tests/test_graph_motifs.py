"""The motifs task: BA-2Motifs generated offline, its node metrics, the built-in model, the runner."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

pytest.importorskip("torch_geometric")

from captum_transformers.errors import InputError  # noqa: E402
from captum_transformers.evaluation.graphs.node_perturbation import (NodeActivation, NodeAUROC, NodePruning,  # noqa: E402
                                                              graph_auroc, masked_logits)
from captum_transformers.tasks.motifs.graphs import BASE_NODES, MOTIF_NODES, motif_graphs  # noqa: E402


def test_generation_is_reproducible_and_leaves_the_global_generators_alone():
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    before = (torch.rand(1), random.random(), np.random.rand())
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    first = motif_graphs(6, seed=3)
    after = (torch.rand(1), random.random(), np.random.rand())
    assert before[0] == after[0] and before[1] == after[1] and before[2] == after[2]
    again = motif_graphs(6, seed=3)
    assert torch.equal(first.edge_index, again.edge_index) and torch.equal(first.x, again.x)
    other = motif_graphs(6, seed=4)
    assert not (first.edge_index.shape == other.edge_index.shape and torch.equal(first.edge_index, other.edge_index))


def test_ground_truth_is_the_motif():
    data = motif_graphs(6, seed=0)
    assert data.labels.tolist() == [0, 1, 0, 1, 0, 1]
    for g in range(6):
        nodes = data.batch == g
        truth = data.node_truth[nodes]
        assert truth.sum() == MOTIF_NODES and truth[BASE_NODES:].all()
        motif_edges = data.edge_truth & nodes[data.edge_index[0]]
        # A house has 6 undirected edges, a 5-cycle 5 (both directions stored).
        assert int(motif_edges.sum()) == (12 if data.labels[g] == 0 else 10)
    pairs = motif_graphs(4, seed=0, two_motifs=True)
    for g in range(4):
        kinds = pairs.motif[pairs.batch == g]
        assert (kinds == 0).sum() == MOTIF_NODES and (kinds == 1).sum() == MOTIF_NODES


def test_graph_auroc_by_hand_and_the_accumulator():
    scores = torch.tensor([0.9, 0.1, 0.5, 0.5])
    truth = torch.tensor([True, False, True, False])
    # pairs (pos, neg): (0.9>0.1), (0.9>0.5), (0.5>0.1), (0.5=0.5 -> half): 3.5 / 4
    assert graph_auroc(scores, truth) == 0.875
    metric = NodeAUROC()
    batch = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    metric.update(torch.cat([scores, torch.ones(3)]), torch.cat([truth, torch.tensor([True, False, False])]), batch)
    result = metric.compute()
    assert result.count == 2 and result.value == pytest.approx((0.875 + 0.5) / 2)
    with pytest.raises(InputError):
        metric.update(scores, truth, batch)


def _counting_forward(x, edge_index, batch):
    """Per graph: (number of edges present, sum of node features): shows what masking keeps."""
    graphs = int(batch.max()) + 1
    edges = torch.zeros(graphs).index_add_(0, batch[edge_index[0]], torch.ones(edge_index.shape[1]))
    features = torch.zeros(graphs).index_add_(0, batch, x.sum(-1))
    return torch.stack([edges, features], dim=-1)


def test_masked_nodes_lose_their_features_and_edges():
    x = torch.ones(4, 2)
    edge_index = torch.tensor([[0, 1, 1, 2, 3], [1, 0, 2, 1, 2]])
    batch = torch.zeros(4, dtype=torch.long)
    kept = torch.tensor([[True, True, True, True], [True, True, False, True], [False] * 4])
    logits = masked_logits(_counting_forward, x, edge_index, batch, kept)
    assert logits[:, 0].tolist() == [[5.0, 8.0], [2.0, 6.0], [0.0, 0.0]]


def test_activation_rewards_revealing_what_the_model_reads_first():
    x = torch.zeros(6, 1)
    x[[1, 4]] = 1.0  # the class-1 evidence the model reads
    edge_index = torch.tensor([[0, 1, 2, 3, 4, 5], [1, 2, 0, 4, 5, 3]])
    batch = torch.tensor([0, 0, 0, 1, 1, 1])

    def forward(x, edge_index, batch):
        evidence = torch.zeros(int(batch.max()) + 1).index_add_(0, batch, x[:, 0])
        return torch.stack([torch.zeros_like(evidence), 4 * evidence], dim=-1)

    labels = torch.tensor([1, 1])
    good, bad = NodeActivation(forward), NodeActivation(forward)
    good.update(x, edge_index, batch, x[:, 0], labels)
    bad.update(x, edge_index, batch, -x[:, 0], labels)
    assert good.compute().auc > bad.compute().auc
    pruning_good, pruning_bad = NodePruning(forward), NodePruning(forward)
    pruning_good.update(x, edge_index, batch, x[:, 0])
    pruning_bad.update(x, edge_index, batch, 1 - x[:, 0])
    assert pruning_good.compute().auc < pruning_bad.compute().auc


def test_the_built_in_model_and_the_benchmark_run():
    from captum_transformers.tasks.motifs.model import load_motif_model, motif_model_record
    from captum_transformers.tasks.report import table
    from captum_transformers.tasks.runner import run_benchmark

    model = load_motif_model()
    data = motif_graphs(16, seed=1)
    assert (model(data.x, data.edge_index, data.batch).argmax(-1) == data.labels).all()
    assert motif_model_record()["test_accuracy"] >= 0.95
    report = run_benchmark("motifs", methods=["rollout", "conservative-lrp"], limit=4, batch_size=2)
    assert report.examples == 4 and report.methods == ("rollout", "conservative-lrp")
    for metric in ("node_auroc", "auac", "au_mse", "fidelity_plus", "fidelity_minus", "class_specificity"):
        report.result("rollout", metric)
    assert report.result("rollout", "class_specificity").specificity == pytest.approx(0.5)  # class-agnostic
    assert "node AUROC" in table(report)


def test_training_runs():
    from captum_transformers.tasks.motifs.train import train

    result = train(epochs=1, train_graphs=32)
    assert len(result["losses"]) == 1 and 0.0 <= result["test_accuracy"] <= 1.0


def test_explain_draws_motif_graphs_and_refuses_methods_that_do_not_apply(tmp_path, capsys):
    from captum_transformers.cli import main

    assert main(["explain", "--motifs", "2", "--method", "rollout", "--method", "conservative-lrp",
                 "--out", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "explanations.png").stat().st_size > 0
    assert main(["explain", "--motifs", "1", "--method", "transformer-relevance", "--out", str(tmp_path / "no")]) == 2
    assert "do not apply" in capsys.readouterr().err


def test_the_motif_picture_colours_each_map_by_its_methods_signedness(tmp_path, monkeypatch):
    """A signed method whose maps happen to be all positive keeps the diverging colours, and an
    unsigned one the sequential ramp: decided by the method, never by one graph's values."""
    import networkx as nx

    from captum_transformers.cli import graph_explain
    from captum_transformers.tasks.motifs.graphs import motif_graphs
    from captum_transformers.tasks.motifs.train import TEST_SEED

    pytest.importorskip("matplotlib")
    data = motif_graphs(2, seed=TEST_SEED)
    seen = []
    drawn = nx.draw_networkx_nodes
    monkeypatch.setattr(nx, "draw_networkx_nodes", lambda *a, **k: (seen.append((k["cmap"], k["vmin"])), drawn(*a, **k))[1])
    positive = torch.rand(data.x.shape[0]) + 0.1
    graph_explain.graph_grid(data, {"conservative-lrp": positive, "rollout": positive}, ["a", "b"], tmp_path / "g.png")
    assert seen[0][0] == "bwr" and seen[0][1] < 0 and seen[1] == ("Reds", 0.0)
