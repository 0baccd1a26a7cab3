"""The package's metrics computed from a store: the maps read back, not explained again.

``evaluate_store(out, source, metrics)`` walks a finished classifier store in its own batches,
takes each batch's inputs from ``source`` (the data the store explains: its fingerprint must be
the manifest's) and the explained classes and maps from the store, and calls each metric's
``update``. A store's maps are the method's own float32 maps, so a metric computed from the store
equals the same metric fed the live maps, bit for bit. Under ``torchrun`` each process reads
every ``WORLD_SIZE``-th shard (as the job wrote them) and the metrics' exact sums are then
all-reduced (:func:`~captum_transformers.evaluation.all_reduce_metrics`), so every rank ends with
the whole store's result, equal to one process's.

How a batch reaches a metric: images ``metric.update(images, targets, maps)`` (maps of the
stored shape, e.g. (B, H, W)); graphs ``metric.update(x, edge_index, batch, node_scores,
targets)`` (node scores (N,) put back in the batch's node order); token ids ``metric.update(input_ids, attention_mask, relevance,
targets)`` with ``relevance`` (B, S), each row's stored map put back at its unpadded positions
(zeros at padding). Other signatures: pass ``update(metric, inputs, forward_kwargs, targets,
maps)``, with ``maps`` the list of the rows' stored tensors.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Union

import torch

from ..errors import InputError
from ..evaluation import Accumulator, all_reduce_metrics
from .job import rank_and_world
from .sources import CorpusSource
from .store import finished, read_manifest, rows_to_maps, shard_path, shard_plan

Update = Callable[[Accumulator, tuple, dict, torch.Tensor, List[torch.Tensor]], None]


def evaluate_store(out: Union[str, Path], source: CorpusSource, metrics: Sequence[Accumulator], *,
                   batch_size: Optional[int] = None, update: Optional[Update] = None,
                   rank: Optional[int] = None, world_size: Optional[int] = None) -> List[Any]:
    """Update ``metrics`` with every row of the classifier store ``out`` and return their
    ``compute()`` results, in order. ``batch_size`` defaults to the job's; ``rank`` /
    ``world_size`` to torchrun's (then, with ``torch.distributed`` initialised, the metrics are
    all-reduced before computing). Refused: a store not finished, a generation store, a source
    other than the one the store explains."""
    out = Path(out)
    metrics = list(metrics)
    if not metrics or not all(isinstance(metric, Accumulator) for metric in metrics):
        raise InputError(f"metrics must be a non-empty list of the package's metrics (Accumulator), received "
                         f"{[type(m).__name__ for m in metrics] or 'nothing'}.")
    manifest = read_manifest(out)
    if manifest.get("kind", "classifier") != "classifier":
        raise InputError(f"{out} is a {manifest.get('kind')} store; evaluate_store reads classifier stores.")
    if (manifest["source"], manifest["rows"]) != (source.fingerprint, source.rows):
        raise InputError(f"{out} explains {manifest['rows']} rows of {manifest['source']!r}, but the source given is "
                         f"{source.rows} rows of {source.fingerprint!r}; pass the data the store was computed from.")
    rank, world_size = rank_and_world(rank, world_size)
    batch_size = manifest["batch_size"] if batch_size is None else batch_size
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise InputError(f"batch_size must be a positive int, received {batch_size!r}.")
    mine = [shard for shard in shard_plan(manifest["rows"], manifest["shard_rows"]) if shard[0] % world_size == rank]
    unfinished = [shard for shard, start, stop in mine if not finished(out, shard, start, stop)]
    if unfinished:
        raise InputError(f"{out} is not finished: shards {unfinished[:5]} are missing or damaged. Run the job's "
                         "command again to finish it, then evaluate.")
    import pyarrow.parquet as pq

    for shard, start, stop in mine:
        table = pq.read_table(shard_path(out, shard))
        targets_all = torch.tensor(table.column("target").to_pylist(), dtype=torch.long)
        maps_all = rows_to_maps(table)
        for low in range(start, stop, batch_size):
            high = min(low + batch_size, stop)
            inputs, forward_kwargs, _ = source.batch(low, high)
            targets, maps = targets_all[low - start:high - start], maps_all[low - start:high - start]
            for metric in metrics:
                if update is not None:
                    update(metric, inputs, forward_kwargs, targets, maps)
                elif source.value_kind == "graph":
                    metric.update(*inputs, _node_scores(maps, inputs), targets)
                elif inputs[0].is_floating_point():
                    metric.update(inputs[0], targets, torch.stack(maps))
                else:
                    metric.update(inputs[0], forward_kwargs["attention_mask"],
                                  _padded(maps, forward_kwargs.get("attention_mask"), inputs[0]), targets)
    all_reduce_metrics(metrics)
    return [metric.compute() for metric in metrics]


def _node_scores(maps: List[torch.Tensor], inputs: tuple) -> torch.Tensor:
    """(N,) node scores of a graph batch ``(x, edge_index, batch)`` from its rows' stored maps."""
    from ..adapters.graph.nodes import GraphBatch

    nodes = GraphBatch.of(inputs[2].cpu(), inputs[0].shape[0])
    width = max(int(count) for count in nodes.counts)
    padded = torch.zeros(len(maps), width)
    for graph, values in enumerate(maps):
        padded[graph, :values.numel()] = values
    return padded[nodes.graph, nodes.position]


def _padded(maps: List[torch.Tensor], mask: Optional[torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """(B, S) relevance: row i's stored map at the positions its attention mask keeps, 0 elsewhere."""
    if mask is None:
        raise InputError("a token metric needs the batch's attention_mask; the source gives none. Pass update= to "
                         "call the metric yourself.")
    relevance = torch.zeros(ids.shape, dtype=torch.float32)
    for row, values in enumerate(maps):
        kept = mask[row].bool()
        if values.dim() != 1 or values.numel() != int(kept.sum()):
            raise InputError(f"row {row} of the batch has a stored map of shape {tuple(values.shape)} but "
                             f"{int(kept.sum())} unpadded tokens; this store was not computed from this source.")
        relevance[row, kept] = values
    return relevance
