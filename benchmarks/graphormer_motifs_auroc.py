"""Node AUROC of every method on the built-in BA-2Motifs Graphormer's 200 test graphs: how
well each node score separates the five motif nodes from the 25 others, per graph (ties
count one half), with the true class as the target. Scores as returned (signed for the LRP
methods) and their absolute values. Plain Python sums in float64; no torchmetrics.

    OMP_NUM_THREADS=1 python benchmarks/graphormer_motifs_auroc.py

Measured (CPU, one thread; mean over graphs, worst graph in brackets, signed | absolute):
see docs/graphs.md.
"""
from __future__ import annotations

import time

import torch

from captum_transformers.methods.catalog import PACKAGE_METHOD_NAMES, build_method
from captum_transformers.tasks.graphormer_motifs import collate, load_motif_graphormer, motif_graphs, split


def node_auroc(scores: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """Per graph, P(score of a motif node > score of another node) + P(tie) / 2."""
    values = []
    for score, mask in zip(scores.double(), truth):
        positive, negative = score[mask], score[~mask]
        greater = (positive[:, None] > negative[None, :]).double().sum()
        ties = (positive[:, None] == negative[None, :]).double().sum()
        values.append((greater + 0.5 * ties) / (len(positive) * len(negative)))
    return torch.stack(values)


def main() -> None:
    model = load_motif_graphormer()
    _, test = split(motif_graphs())
    batch, labels = collate(test)
    nodes = batch.pop("input_nodes")
    truth = torch.stack([graph["node_mask"] for graph in test])
    with torch.no_grad():
        print(f"test accuracy {(model(nodes, **batch).logits.argmax(-1) == labels).double().mean().item():.3f}")
    print(f"{'method':22s} {'signed':>16s} {'absolute':>16s} {'house/cycle (signed)':>22s} {'seconds':>8s}")
    for name in PACKAGE_METHOD_NAMES:
        started = time.perf_counter()
        tokens = build_method(name, model).attribute(nodes, target=labels, forward_kwargs=batch, return_tokens=True)
        seconds = time.perf_counter() - started
        scores = tokens[:, 1:]  # the graph token dropped
        signed, absolute = node_auroc(scores, truth), node_auroc(scores.abs(), truth)
        house, cycle = signed[labels == 0].mean().item(), signed[labels == 1].mean().item()
        print(f"{name:22s} {signed.mean():.3f} ({signed.min():.3f})   {absolute.mean():.3f} ({absolute.min():.3f})"
              f"   {house:.3f} / {cycle:.3f}      {seconds:.2f}")


if __name__ == "__main__":
    main()
