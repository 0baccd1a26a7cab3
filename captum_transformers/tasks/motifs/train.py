"""Reproducible training of the built-in BA-2Motifs model (the shipped ``assets/motif_transformer.pt``).

Run::

    python -m captum_transformers.tasks.motifs.train [--out PATH] [--epochs N] [--seed S]

Recipe: ``TRAIN_GRAPHS`` graphs generated with ``seed`` (classes alternate), batches of 32
graphs, Adam (lr 3e-3), cross-entropy; one thread and deterministic algorithms, so the same
seed gives the same weights on the same software. The last epoch's model is scored on
``TEST_GRAPHS`` graphs generated with ``TEST_SEED`` (the benchmark's graphs); the accuracy,
seed, time and command go to the JSON record next to the weights.

Example::

    >>> result = train(epochs=1, train_graphs=64)
    >>> sorted(result)
    ['losses', 'model', 'test_accuracy', 'train_seconds']
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict

import torch

from .graphs import motif_graphs
from .model import HEADS, HIDDEN, LAYERS, RECORD_FILE, WEIGHTS_FILE, MotifTransformer
from ..shipped_weights import save_shipped

TRAIN_GRAPHS = 1000
TEST_GRAPHS = 200
TEST_SEED = 1
DEFAULT_EPOCHS = 40
DEFAULT_SEED = 0
BATCH_GRAPHS = 32


def accuracy(model: MotifTransformer, data) -> float:
    with torch.no_grad():
        predicted = model(data.x, data.edge_index, data.batch).argmax(-1)
    return float((predicted == data.labels).double().mean())


def train(epochs: int = DEFAULT_EPOCHS, seed: int = DEFAULT_SEED, train_graphs: int = TRAIN_GRAPHS,
          log: Callable[[str], None] = lambda line: None) -> Dict[str, Any]:
    """Train a :class:`MotifTransformer`; returns the model (eval mode), losses, test accuracy, time."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        return _train(epochs, seed, train_graphs, log)
    finally:
        torch.use_deterministic_algorithms(deterministic)


def _train(epochs: int, seed: int, train_graphs: int, log: Callable[[str], None]) -> Dict[str, Any]:
    data = motif_graphs(train_graphs, seed=seed + 100)  # train graphs never overlap the test seed's
    torch.manual_seed(seed)
    model = MotifTransformer()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    start = time.perf_counter()
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(train_graphs, generator=generator)
        total = 0.0
        for first in range(0, train_graphs, BATCH_GRAPHS):
            chosen = order[first:first + BATCH_GRAPHS]
            part = _select(data, chosen)
            loss = torch.nn.functional.cross_entropy(model(part.x, part.edge_index, part.batch), part.labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * len(chosen)
        losses.append(total / train_graphs)
        log(f"epoch {epoch + 1}/{epochs}: loss {losses[-1]:.4f}")
    seconds = time.perf_counter() - start
    model.eval()
    test = motif_graphs(TEST_GRAPHS, seed=TEST_SEED)
    return {"model": model, "losses": losses, "test_accuracy": accuracy(model, test), "train_seconds": seconds}


def _select(data, graphs: torch.Tensor):
    """The graphs ``graphs`` (indices) of ``data`` as one batch, in that order."""
    from .graphs import MotifGraphs

    parts = [data.graphs(int(g), int(g) + 1) for g in graphs]
    offsets = torch.tensor([0] + [len(p.x) for p in parts]).cumsum(0)
    return MotifGraphs(torch.cat([p.x for p in parts]),
                       torch.cat([p.edge_index + offsets[i] for i, p in enumerate(parts)], dim=1),
                       torch.cat([torch.full((len(p.x),), i) for i, p in enumerate(parts)]),
                       torch.cat([p.labels for p in parts]), torch.cat([p.node_truth for p in parts]),
                       torch.cat([p.edge_truth for p in parts]), torch.cat([p.motif for p in parts]))


def save(result: Dict[str, Any], out: Path, command: str, epochs: int, seed: int) -> Path:
    """Write the state dict to ``out`` and its JSON record beside it (same stem, ``.json``)."""
    import torch_geometric

    record = {
        "test_accuracy": round(result["test_accuracy"], 4), "test_graphs": TEST_GRAPHS, "test_seed": TEST_SEED,
        "train_graphs": TRAIN_GRAPHS, "epochs": epochs, "seed": seed, "final_loss": round(result["losses"][-1], 4),
        "train_seconds": round(result["train_seconds"], 1), "threads": torch.get_num_threads(), "command": command,
        "model": {"hidden": HIDDEN, "heads": HEADS, "layers": LAYERS},
        "versions": {"torch": torch.__version__, "torch_geometric": torch_geometric.__version__},
    }
    return save_shipped(result["model"].state_dict(), out, record)


def main(argv=None) -> int:
    default_out = Path(__file__).resolve().parents[2] / "assets" / WEIGHTS_FILE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=default_out, help=f"weights path (default: {default_out}); "
                        f"the record goes beside it with suffix .json ({RECORD_FILE} for the default)")
    parser.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads (the same seed and thread count give the same weights)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    command = "python -m captum_transformers.tasks.motifs.train " + " ".join(
        f"--{name} {getattr(args, name)}" for name in ("epochs", "seed", "threads"))
    result = train(args.epochs, args.seed, log=lambda line: print(line, flush=True))
    path = save(result, args.out, command, args.epochs, args.seed)
    print(f"test accuracy {result['test_accuracy']:.4f}, {result['train_seconds']:.0f} s -> {path} "
          f"({os.path.getsize(path) / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
