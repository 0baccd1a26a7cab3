"""Wall time of every method that applies to PyG sparse attention, relative to a forward pass
and a training step (forward + backward to the parameters), on the built-in motif model.

    python benchmarks/graph_methods.py [--graphs 64] [--repeats 5]

Batch: ``--graphs`` BA-2Motifs test graphs (25 nodes each) in one PyG batch; one thread;
median of ``--repeats`` runs after one warm-up.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from captum_transformers.cli.graph_explain import GRAPH_METHODS
from captum_transformers.methods.catalog import build_method
from captum_transformers.tasks.motifs.graphs import motif_graphs
from captum_transformers.tasks.motifs.model import load_motif_model


def _median(work, repeats: int) -> float:
    work()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, data = load_motif_model(), motif_graphs(args.graphs, seed=1)
    inputs = (data.x, data.edge_index, data.batch)

    def forward():
        with torch.no_grad():
            model(*inputs)

    def training_step():
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(*inputs), data.labels).backward()
        model.zero_grad()

    plain = _median(forward, args.repeats)
    step = _median(training_step, args.repeats)
    print(f"{args.graphs} graphs, {data.x.shape[0]} nodes: forward {plain * 1000:.1f} ms, "
          f"training step {step * 1000:.1f} ms")
    print("| method | time | vs forward | vs training step |")
    print("|---|---|---|---|")
    for name in GRAPH_METHODS:
        explainer = build_method(name, model)
        seconds = _median(lambda: explainer.attribute(data.x, target=data.labels,
                                                      additional_forward_args=(data.edge_index, data.batch)),
                          args.repeats)
        print(f"| {name} | {seconds * 1000:.1f} ms | {seconds / plain:.2f}x | {seconds / step:.2f}x |")


if __name__ == "__main__":
    main()
