"""Every method on the built-in motifs Graphormer (``tasks.motifs.graphormer``) over the
motifs task's 200 test graphs: node AUROC against the motif's nodes, and Ali et al.'s AUAC
(activation: reveal the most relevant nodes first; higher is better) and AU-MSE (pruning: mask
the least relevant first; lower is better) over nodes, with the metrics of
``evaluation.node_perturbation`` (a masked node has zero features, i.e. category 0, and no
edges). The target is the true class. Scores as returned (signed for the LRP methods) and,
for AUROC, their absolute values. Class specificity on the task's 200 two-motif graphs (a
house and a cycle on each; seed 2, as the task's benchmark): each method explains "house" and
"cycle" on the same graph; the share of positive relevance on the explained motif
(``evaluation.ClassSpecificity``; above 0.5: the map follows the class).

    OMP_NUM_THREADS=1 python benchmarks/graphormer_motifs.py [weights folder]

Measured on one CPU thread: see docs/graphs.md.
"""
from __future__ import annotations

import sys
import time

import torch

from captum_transformers.evaluation import ClassSpecificity
from captum_transformers.evaluation.graphs.node_perturbation import NodeActivation, NodeAUROC, NodePruning
from captum_transformers.methods.catalog import METHOD_NAMES, PACKAGE_METHOD_NAMES, build_method
from captum_transformers.tasks.motifs.graphs import motif_graphs
from captum_transformers.tasks.motifs.graphormer import graphormer_forward, graphormer_inputs, load_motif_graphormer
from captum_transformers.tasks.motifs.train import TEST_GRAPHS, TEST_SEED

CHUNK = 50  # graphs per attribute / metric update


def main() -> None:
    model = load_motif_graphormer(sys.argv[1] if len(sys.argv) > 1 else None)  # a retrained folder, optional
    data = motif_graphs(TEST_GRAPHS, seed=TEST_SEED)
    forward = graphormer_forward(model)
    with torch.no_grad():
        accuracy = (forward(data.x, data.edge_index, data.batch).argmax(-1) == data.labels).double().mean()
    print(f"test accuracy {accuracy.item():.3f} on {TEST_GRAPHS} graphs")
    pairs = motif_graphs(TEST_GRAPHS, seed=TEST_SEED + 1, two_motifs=True)
    print(f"{'method':22s} {'AUROC':>7s} {'|AUROC|':>8s} {'AUAC':>7s} {'AU-MSE':>8s} {'share':>7s} {'seconds':>8s}")
    for name in [name for name in PACKAGE_METHOD_NAMES if name in METHOD_NAMES]:  # not the on-request ones
        explainer = build_method(name, model)
        signed, absolute, activation, pruning = NodeAUROC(), NodeAUROC(), NodeActivation(forward), NodePruning(forward)
        specificity = ClassSpecificity()
        seconds = 0.0
        for start in range(0, TEST_GRAPHS, CHUNK):
            part = data.graphs(start, start + CHUNK)
            inputs = graphormer_inputs(part.x, part.edge_index, part.batch)
            started = time.perf_counter()
            tokens = explainer.attribute(inputs, target=part.labels, return_tokens=True)
            seconds += time.perf_counter() - started
            real = inputs["input_nodes"][:, :, 0] != 0
            scores = tokens[real]  # nodes in the flat batch's order
            signed.update(scores, part.node_truth, part.batch)
            absolute.update(scores.abs(), part.node_truth, part.batch)
            activation.update(part.x, part.edge_index, part.batch, scores, part.labels)
            pruning.update(part.x, part.edge_index, part.batch, scores)
            both = pairs.graphs(start, start + CHUNK)
            inputs = graphormer_inputs(both.x, both.edge_index, both.batch)
            real = inputs["input_nodes"][:, :, 0] != 0
            motif = torch.full(real.shape, -1, dtype=torch.long)
            motif[real] = both.motif
            maps = [explainer.attribute(inputs, target=torch.full((both.num_graphs,), cls), return_tokens=True)
                    for cls in (0, 1)]
            specificity.update(maps[0][..., None], maps[1][..., None], (motif == 0).double()[..., None],
                               (motif == 1).double()[..., None])
        print(f"{name:22s} {signed.compute().value:7.3f} {absolute.compute().value:8.3f} "
              f"{activation.compute().auc:7.3f} {pruning.compute().auc:8.3f} {specificity.compute().specificity:7.3f} "
              f"{seconds:8.2f}")


if __name__ == "__main__":
    main()
