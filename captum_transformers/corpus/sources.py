"""Where a corpus job's rows come from: a :class:`CorpusSource` gives the number of rows, a
fingerprint of its content (kept in the store's manifest, so a resumed run reads the same
data) and the model inputs of any run of rows.

Two sources ship: :func:`digit_canvas_source` (the built-in DigitCanvas split, generated
deterministically) and :func:`table_source` (a Parquet file or folder, or a JSON-lines file,
one row per example; a column of raw values turned into model inputs by ``prepare``, e.g. the
texts a tokenizer reads). Rows are numbered 0..N-1 in the source's order; that number is the
``row_id`` of the store.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import InputError

#: ``prepare(values) -> (inputs, forward_kwargs, displays)``: one batch of model inputs from a list of
#: raw values (``LoadedModel.prepare``'s contract); ``displays`` are per-row tokens (text) or anything else.
Prepare = Callable[[List[Any]], Tuple[Tuple[torch.Tensor, ...], Dict[str, Any], list]]


@dataclass
class CorpusSource:
    """``rows`` examples, ``batch(start, stop)`` the model inputs of rows ``start..stop-1``:
    ``(inputs, forward_kwargs, tokens or None)``; ``fingerprint`` names the content exactly."""

    rows: int
    fingerprint: str
    load: Callable[[int, int], Tuple[Tuple[torch.Tensor, ...], Dict[str, Any], Optional[List[List[str]]]]]
    description: str = ""
    labels: Optional[torch.Tensor] = field(default=None, repr=False)

    def batch(self, start: int, stop: int):
        if not 0 <= start < stop <= self.rows:
            raise InputError(f"rows {start}..{stop - 1} asked of a source of {self.rows} rows.")
        return self.load(start, stop)


def digit_canvas_source(rows: int, split: str = "test", seed: int = 0) -> CorpusSource:
    """``rows`` DigitCanvas canvases of ``split`` (one digit each, the built-in model's inputs,
    normalised), generated once and bit-identical for the same arguments."""
    from ..tasks.digits.canvas import digit_canvases, normalize

    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        raise InputError(f"a digit canvas source needs at least 1 row, received rows={rows!r}.")
    canvases = digit_canvases(split=split, variant="one", n=rows, seed=seed)
    images = normalize(canvases.images)

    def load(start, stop):
        return (images[start:stop],), {}, None

    return CorpusSource(rows, f"digit-canvases:{split}:one:n={rows}:seed={seed}", load,
                        f"{rows} DigitCanvas {split} canvases", canvases.labels)


def table_source(path, prepare: Prepare, column: str = "text") -> CorpusSource:
    """The values of ``column`` in a Parquet file or folder of Parquet files, or a JSON-lines file
    (``.jsonl`` / ``.json``), in file order, turned into model inputs a batch at a time by
    ``prepare``. The fingerprint is the SHA-256 of the files' bytes and the column's name."""
    path = Path(path).expanduser()
    if not path.exists():
        raise InputError(f"--data {str(path)!r}: no such file or folder; expected a Parquet file or folder, "
                         "or a JSON-lines file.")
    files = sorted(p for p in path.rglob("*.parquet")) if path.is_dir() else [path]
    if not files:
        raise InputError(f"--data {str(path)!r} is a folder with no .parquet files.")
    digest = hashlib.sha256(column.encode())
    for file in files:
        digest.update(file.read_bytes())
    values = _column(files, column)
    if not values:
        raise InputError(f"--data {str(path)!r} has no rows.")

    def load(start, stop):
        inputs, forward_kwargs, displays = prepare(values[start:stop])
        tokens = displays if displays and isinstance(displays[0], (list, tuple)) else None
        return tuple(inputs), dict(forward_kwargs or {}), tokens

    return CorpusSource(len(values), f"table:{column}:sha256={digest.hexdigest()}", load,
                        f"{len(values)} rows of {column!r} in {path}")


def _column(files: Sequence[Path], column: str) -> list:
    if files[0].suffix in (".jsonl", ".json"):
        values = []
        with open(files[0], encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if not isinstance(record, dict) or column not in record:
                    raise InputError(f"{files[0]} line {number} has no {column!r} field; every line must be a JSON "
                                     f"object with {column!r} (choose the field with --column).")
                values.append(record[column])
        return values
    if files[0].suffix != ".parquet":
        raise InputError(f"--data {str(files[0])!r}: expected a .parquet, .jsonl or .json file, or a folder of "
                         ".parquet files.")
    import pyarrow.parquet as pq

    values = []
    for file in files:
        table = pq.read_table(file)
        if column not in table.column_names:
            raise InputError(f"{file} has no column {column!r}; its columns are {table.column_names} "
                             "(choose one with --column).")
        values.extend(table.column(column).to_pylist())
    return values
