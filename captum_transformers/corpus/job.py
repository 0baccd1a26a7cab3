"""The corpus job: every row of a source explained by one method, written to a store.

The source's rows are cut into shards of ``shard_rows`` (the same cut for every run and every
number of processes), and shard ``i`` is computed by rank ``i % world_size``: under ``torchrun``
(or ``accelerate launch``) each process reads ``RANK`` / ``WORLD_SIZE`` and writes its own
shards, with no scheduler and no traffic between them but one barrier at the end. A shard is
computed in batches of ``batch_size`` rows, each one call of the method (its forward and
backward over the whole batch) plus one no-grad forward for the explained class and its logit.
Re-running the same job skips every finished, intact shard (see :mod:`.store`), so a run
killed at any point resumes where it stopped and the final store equals an uninterrupted run's
bit for bit: the same rows meet in the same batches whatever was interrupted.
"""
from __future__ import annotations

import hashlib
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Union

import torch
from torch import nn

from ..capture.targets import output_scores
from ..errors import InputError
from ..methods.catalog import build_method, catalog_entry
from .sources import CorpusSource
from .store import (MANIFEST, claim_manifest, finished, record_path, release_unused_manifest, shard_path,
                    shard_plan, write_shard)


@dataclass(frozen=True)
class CorpusRun:
    """What one process did: shards it computed (``recomputed`` of them were damaged or
    unfinished leftovers of an earlier run), shards it found finished, rows it explained."""

    out: Path
    rank: int
    world_size: int
    shards_computed: int
    shards_skipped: int
    recomputed: int
    rows_computed: int
    seconds: float


def weights_sha256(model: nn.Module) -> str:
    """SHA-256 of the model's parameters and buffers (names, dtypes, shapes and bytes)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def _versions() -> Dict[str, Optional[str]]:
    from .. import __version__

    try:
        import transformers
        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = None
    return {"captum_transformers": __version__, "torch": torch.__version__, "transformers": transformers_version,
            "python": platform.python_version()}


def rank_and_world(rank: Optional[int], world_size: Optional[int]):
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise InputError(f"rank {rank} of world size {world_size}: expected 0 <= rank < world_size "
                         "(torchrun sets RANK and WORLD_SIZE).")
    return rank, world_size


def job_settings(model: nn.Module, kind: str, method: str, source_fingerprint: str, rows: int, shard_rows: int,
                 batch_size: int, **extra: Any) -> Dict[str, Any]:
    """The manifest of a ``kind`` job: what makes two runs the same run (a resumed run must
    match every entry), ``extra`` the kind's own (target, score, generation length ...)."""
    for name, value in (("batch_size", batch_size), ("shard_rows", shard_rows)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InputError(f"{name} must be a positive int, received {value!r}.")
    parameter = next(iter(model.parameters()), None)
    return {"format": "captum-transformers corpus store 2", "kind": kind, "method": method,
            "model_class": type(model).__name__, "weights_sha256": weights_sha256(model),
            "dtype": str(parameter.dtype) if parameter is not None else None,
            "device_kind": parameter.device.type if parameter is not None else "cpu", "source": source_fingerprint,
            "rows": rows, "shard_rows": shard_rows, "batch_size": batch_size, **extra, **_versions()}


def run_shards(model: nn.Module, out: Union[str, Path], settings: Dict[str, Any],
               explain_rows: Callable[[int, int], Dict[str, list]], *, rank: Optional[int] = None,
               world_size: Optional[int] = None, progress: bool = True) -> CorpusRun:
    """The job's loop, shared by every kind: claim the manifest (or match it), take this rank's
    unfinished shards, fill each with ``explain_rows(low, high)`` (the columns of rows
    ``low..high-1``, one batch) and write it atomically; the model is in eval mode meanwhile."""
    rank, world_size = rank_and_world(rank, world_size)
    out = Path(out)
    fresh = not (out / MANIFEST).exists()
    claim_manifest(out, settings)
    rows, shard_rows, batch_size = settings["rows"], settings["shard_rows"], settings["batch_size"]
    mine = [shard for shard in shard_plan(rows, shard_rows) if shard[0] % world_size == rank]
    todo = [shard for shard in mine if not finished(out, *shard)]
    recomputed = sum(1 for shard, _, _ in todo if shard_path(out, shard).exists() or record_path(out, shard).exists())
    bar = _progress(sum(stop - start for _, start, stop in todo), progress and rank == 0,
                    f"{settings['method']} (rank 0 of {world_size})")
    began = time.perf_counter()
    model_was_training = model.training
    model.eval()
    try:
        for shard, start, stop in todo:
            columns: Dict[str, list] = {}
            for low in range(start, stop, batch_size):
                high = min(low + batch_size, stop)
                for name, values in explain_rows(low, high).items():
                    columns.setdefault(name, []).extend(values)
                if bar is not None:
                    bar.update(high - low)
            write_shard(out, shard, start, stop, columns,
                        {"rank": rank, "world_size": world_size, "host": platform.node()}, settings["kind"])
    except BaseException:
        if fresh and world_size == 1:
            release_unused_manifest(out)  # a first batch that failed leaves the folder free for another run
        raise
    finally:
        model.train(model_was_training)
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - began
    _barrier(world_size)
    return CorpusRun(out, rank, world_size, len(todo), len(mine) - len(todo), recomputed,
                     sum(stop - start for _, start, stop in todo), seconds)


def explain_dataset(model: nn.Module, source: CorpusSource, method: str, out: Union[str, Path], *,
                    batch_size: int = 32, shard_rows: int = 256, target: str = "predicted",
                    rank: Optional[int] = None, world_size: Optional[int] = None,
                    progress: bool = True) -> CorpusRun:
    """Explain every row of ``source`` with the catalog method ``method`` and write the maps to
    the store ``out`` (see :mod:`captum_transformers.corpus.store` for its layout and schema).

    ``target``: ``"predicted"`` (the model's arg-max class, default) or ``"label"`` (the source's
    labels). ``rank`` / ``world_size`` default to torchrun's ``RANK`` / ``WORLD_SIZE``. Running the
    same call again resumes: finished shards are kept, others computed; a call with other settings
    (method, model weights, data, dtype, shard or batch size, versions) into the same ``out`` is
    refused. Returns this process's :class:`CorpusRun`; :func:`~.store.read_store` reads the store.
    For language models' generations see :func:`~.generations.explain_generations`.
    """
    if target not in ("predicted", "label"):
        raise InputError(f"target must be 'predicted' or 'label', received {target!r}.")
    if target == "label" and source.labels is None:
        raise InputError(f"target='label' but the source ({source.description}) has no labels; use 'predicted'.")
    catalog_entry(method)  # an unknown name is refused before any work
    settings = job_settings(model, "classifier", method, source.fingerprint, source.rows, shard_rows, batch_size,
                            target=target)
    attribution = build_method(method, model)
    parameter = next(iter(model.parameters()), None)
    device = parameter.device if parameter is not None else torch.device("cpu")

    def explain_rows(low: int, high: int) -> Dict[str, list]:
        return _explain_batch(model, attribution, source, low, high, target, device, method)

    return run_shards(model, out, settings, explain_rows, rank=rank, world_size=world_size, progress=progress)


def _explain_batch(model, attribution, source, low, high, target, device, method) -> Dict[str, list]:
    inputs, forward_kwargs, tokens = source.batch(low, high)
    inputs = tuple(t.to(device) for t in inputs)
    forward_kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in forward_kwargs.items()}
    with torch.no_grad():
        logits = output_scores(model(*inputs, **forward_kwargs))
    logits = logits[0] if isinstance(logits, (tuple, list)) else logits
    if logits.dim() != 2:
        raise InputError(f"{type(model).__name__} returns scores of shape {tuple(logits.shape)}; a corpus job "
                         "explains classifiers with scores (batch, classes).")
    classes = logits.argmax(-1) if target == "predicted" else source.labels[low:high].to(device)
    text = (tokens is not None or not inputs[0].is_floating_point()) if source.token_maps is None else source.token_maps
    explained, additional = inputs[:source.explained], inputs[source.explained:]
    maps = attribution.attribute(explained[0] if len(explained) == 1 else explained, target=classes,
                                 additional_forward_args=additional or None, forward_kwargs=forward_kwargs or None,
                                 return_tokens=text)
    maps = (maps[0] if isinstance(maps, tuple) else maps).detach().float().cpu()
    mask = forward_kwargs.get("attention_mask")
    rows = source.row_maps(maps, inputs, forward_kwargs) if source.row_maps is not None else list(maps)
    scores = logits.detach().double().gather(1, classes[:, None]).squeeze(1).cpu()
    columns: Dict[str, list] = {key: [] for key in ("row_id", "target", "score", "map", "map_shape", "tokens", "method")}
    for i in range(high - low):
        row = rows[i]
        if source.row_maps is None and mask is not None and row.dim() == 1 and row.shape[0] == mask.shape[1]:
            row = row[mask[i].cpu().bool()]  # the row's own tokens, padding dropped
        columns["row_id"].append(low + i)
        columns["target"].append(int(classes[i]))
        columns["score"].append(float(scores[i]))
        columns["map"].append(row.reshape(-1).numpy())
        columns["map_shape"].append(list(row.shape))
        columns["tokens"].append(None if tokens is None else [str(t) for t in tokens[i]])
        columns["method"].append(method)
    return columns


def _progress(total: int, shown: bool, label: str):
    if not shown or total == 0:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="row", desc=label, file=sys.stderr, dynamic_ncols=True, mininterval=1.0)


def _barrier(world_size: int) -> None:
    """Wait for every rank (torch.distributed, gloo) when torchrun started several; nothing else."""
    if world_size == 1 or "MASTER_ADDR" not in os.environ:
        return
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo")
    try:
        dist.barrier()
    finally:
        if created:
            dist.destroy_process_group()
