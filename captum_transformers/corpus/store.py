"""The store a corpus job writes: a folder of Parquet shards and a manifest.

Layout::

    OUT/manifest.json               the run's settings and provenance (written once)
    OUT/shards/shard-00012.parquet  rows 12*shard_rows .. of the source
    OUT/records/shard-00012.json    the shard's record: its rows, row count and SHA-256

(the records live beside the shards, not among them, so that ``OUT/shards`` holds Parquet files
only and any Parquet reader can take the whole folder).

Nothing is ever half written under a final name: a shard is written to a temporary name in
the same folder and renamed (``os.replace``, atomic on one file system), and its record
after it, the same way; a shard without a record, or whose bytes no longer match the
record's SHA-256, or whose row ids are not its rows, is not finished: the job computes it again.
The manifest is created once, atomically (``os.link`` of a complete temporary file, which
fails if another process made it first); a later run with other settings is refused.

Each shard is a Parquet table with the schema :data:`SCHEMA_DOC` (a classifier job) or
:data:`GENERATION_SCHEMA_DOC` (a generation job; the manifest's ``kind`` says which) documents, readable with
``pyarrow``, ``pandas`` or ``datasets.load_dataset("parquet", data_dir=OUT / "shards")``.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from ..errors import InputError

MANIFEST = "manifest.json"
SHARDS = "shards"
RECORDS = "records"
#: The columns of a classifier job's shards (``explain_dataset``).
SCHEMA_DOC = {
    "row_id": "int64: the row's position in the source (0-based)",
    "target": "int64: the explained class",
    "score": "float64: the model's logit of the target class (what the map explains)",
    "map": "list<float32>: the attribution, flattened in row-major order",
    "map_shape": "list<int32>: the attribution's shape for this row (reshape map to it)",
    "tokens": "list<string>: the row's tokens (text models; null for images)",
    "method": "string: the method's catalog name",
}
#: The columns of a generation job's shards (``explain_generations``): one row per prompt, T
#: output tokens explained over its n prompt tokens and the m output tokens before each.
GENERATION_SCHEMA_DOC = {
    "row_id": "int64: the prompt's position in the source (0-based)",
    "prompt": "string: the prompt as given",
    "input_tokens": "list<string>: the n prompt tokens (the columns of token_attr)",
    "input_ids": "list<int64>: their ids",
    "output_tokens": "list<string>: the T explained output tokens (generated, or given)",
    "output_ids": "list<int64>: their ids",
    "token_attr": "list<float32>: (T, n) row-major: row t explains output token t over the prompt tokens",
    "target_attr": "list<float32>: (T, m) row-major: row t over the output tokens before it",
    "target_attr_tokens": "list<string>: the m columns of target_attr",
    "scores": "list<float64>: each output token's explained score (logit, log_prob or prob)",
    "output_probs": "list<float64>: each output token's probability",
    "method": "string: the method's catalog name",
}
KINDS = ("classifier", "generation")


def arrow_schema(kind: str):
    """The ``pyarrow`` schema of a ``kind`` job's shards (:data:`SCHEMA_DOC`, :data:`GENERATION_SCHEMA_DOC`)."""
    import pyarrow as pa

    if kind == "classifier":
        return pa.schema([("row_id", pa.int64()), ("target", pa.int64()), ("score", pa.float64()),
                          ("map", pa.list_(pa.float32())), ("map_shape", pa.list_(pa.int32())),
                          ("tokens", pa.list_(pa.string())), ("method", pa.string())])
    if kind == "generation":
        return pa.schema([("row_id", pa.int64()), ("prompt", pa.string()), ("input_tokens", pa.list_(pa.string())),
                          ("input_ids", pa.list_(pa.int64())), ("output_tokens", pa.list_(pa.string())),
                          ("output_ids", pa.list_(pa.int64())), ("token_attr", pa.list_(pa.float32())),
                          ("target_attr", pa.list_(pa.float32())), ("target_attr_tokens", pa.list_(pa.string())),
                          ("scores", pa.list_(pa.float64())), ("output_probs", pa.list_(pa.float64())),
                          ("method", pa.string())])
    raise InputError(f"a corpus store of kind {kind!r}: expected one of {KINDS}.")


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in its folder and one rename."""
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def claim_manifest(out: Path, settings: Dict[str, Any]) -> Dict[str, Any]:
    """The store's manifest: created from ``settings`` if the folder has none, else read and
    compared; a run whose settings differ from the folder's is an :class:`InputError` naming
    every difference."""
    out.mkdir(parents=True, exist_ok=True)
    (out / SHARDS).mkdir(exist_ok=True)
    (out / RECORDS).mkdir(exist_ok=True)
    path = out / MANIFEST
    if not path.exists():
        descriptor, temporary = tempfile.mkstemp(prefix=".manifest.", suffix=".part", dir=out)
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            json.dump(settings, handle, indent=2, sort_keys=True)
        try:
            os.link(temporary, path)  # fails if another rank created it first: then compare with theirs
        except FileExistsError:
            pass
        finally:
            os.unlink(temporary)
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise InputError(f"{path} is not a readable manifest ({error}); this folder is not a corpus store, or "
                         "its manifest was damaged: choose another --out.") from error
    differences = [f"{key}: the folder has {found.get(key)!r}, this run {settings.get(key)!r}"
                   for key in sorted(set(found) | set(settings)) if key != "created" and found.get(key) != settings.get(key)]
    if differences:
        raise InputError(f"{out} holds a corpus run with other settings, so resuming into it would mix two runs: "
                         + "; ".join(differences) + ". Use another --out for this run, or the folder's settings "
                         "to resume it.")
    return found


def release_unused_manifest(out: Path) -> None:
    """Remove the manifest of a store that holds no shard and no record yet (a run that failed
    before writing anything, in one process), so that the folder takes another run's settings."""
    if any((out / SHARDS).glob("shard-*")) or any((out / RECORDS).glob("shard-*")):
        return
    (out / MANIFEST).unlink(missing_ok=True)


def shard_path(out: Path, shard: int) -> Path:
    return out / SHARDS / f"shard-{shard:05d}.parquet"


def record_path(out: Path, shard: int) -> Path:
    return out / RECORDS / f"shard-{shard:05d}.json"


def finished(out: Path, shard: int, start: int, stop: int) -> bool:
    """Whether shard ``shard`` (rows ``start..stop-1``) is written and intact: its record
    names these rows and its bytes' SHA-256."""
    data, record = shard_path(out, shard), record_path(out, shard)
    if not (data.exists() and record.exists()):
        return False
    try:
        entry = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return entry.get("rows") == [start, stop] and entry.get("sha256") == sha256_file(data)


def write_shard(out: Path, shard: int, start: int, stop: int, columns: Dict[str, list],
                provenance: Dict[str, Any], kind: str = "classifier") -> None:
    """Write one shard (``columns`` as :func:`arrow_schema` of ``kind``), then its record, each atomically."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = arrow_schema(kind)
    table = pa.Table.from_arrays([_arrow_column(columns[field.name], field.type) for field in schema], schema=schema)
    if table.column("row_id").to_pylist() != list(range(start, stop)):
        raise AssertionError(f"shard {shard} holds rows {table.column('row_id').to_pylist()[:3]}..., "
                             f"expected {start}..{stop - 1}")
    sink = pa.BufferOutputStream()
    # dictionary encoding only where values repeat (the method's name, tokens): tried on the maps'
    # floats it cost 6x the write (38 ms against 6 ms for 256 maps of 3072 floats) for nothing
    pq.write_table(table, sink, use_dictionary=[field.name for field in schema if field.name == "method"
                                                or field.name.endswith("tokens")])
    data = sink.getvalue().to_pybytes()
    _atomic_write(shard_path(out, shard), data)
    record = {"shard": shard, "rows": [start, stop], "n_rows": stop - start,
              "sha256": hashlib.sha256(data).hexdigest(), **provenance}
    _atomic_write(record_path(out, shard), json.dumps(record, indent=2, sort_keys=True).encode())


def _arrow_column(values: list, kind):
    """One column as an Arrow array; a list<float32> column given as NumPy arrays (the maps) is
    built from one concatenated buffer and its offsets, never through Python floats."""
    import numpy as np
    import pyarrow as pa

    if (pa.types.is_list(kind) and pa.types.is_float32(kind.value_type) and values
            and all(isinstance(v, np.ndarray) for v in values)):
        flat = [np.ascontiguousarray(v, dtype=np.float32).reshape(-1) for v in values]
        offsets = np.zeros(len(flat) + 1, dtype=np.int32)
        np.cumsum([len(v) for v in flat], out=offsets[1:])
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(flat), type=pa.float32()))
    return pa.array(values, type=kind)


def read_manifest(out: Path) -> Dict[str, Any]:
    """The manifest of the store ``out``, or an :class:`InputError` saying the folder is not a
    corpus store (no manifest, or one that is not JSON)."""
    try:
        return json.loads((Path(out) / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise InputError(f"{str(out)!r} has no readable {MANIFEST}: not a corpus store written by "
                         f"`captum-transformers attribute` ({type(error).__name__}).") from None


def shard_plan(rows: int, shard_rows: int) -> List[tuple]:
    """``(shard, start, stop)`` for every shard of ``rows`` rows."""
    return [(index, start, min(start + shard_rows, rows)) for index, start in enumerate(range(0, rows, shard_rows))]


def read_store(out) -> "Any":
    """The whole store as one ``pyarrow.Table`` sorted by ``row_id``, after checking it: the
    manifest is readable, every planned shard is finished and intact, and the row ids are
    exactly ``0..rows-1``, none missing and none twice. An unfinished or damaged store is an
    :class:`InputError` naming the shards (run the same job again to finish it)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out)
    manifest = read_manifest(out)
    plan = shard_plan(manifest["rows"], manifest["shard_rows"])
    missing = [shard for shard, start, stop in plan if not finished(out, shard, start, stop)]
    if missing:
        raise InputError(f"{out} is not finished: {len(missing)} of {len(plan)} shards are missing or damaged "
                         f"(first: {missing[:5]}). Run the same command again: it computes only those.")
    table = pa.concat_tables([pq.read_table(shard_path(out, shard)) for shard, _, _ in plan])
    ids = table.column("row_id").to_pylist()
    if ids != list(range(manifest["rows"])):
        raise InputError(f"{out}: the shards' row ids are not 0..{manifest['rows'] - 1} exactly once.")
    return table


def rows_to_maps(table, rows: Optional[Sequence[int]] = None) -> List["Any"]:
    """The maps of ``table``'s rows (all by default) as float32 tensors of their shapes: one
    tensor per row of a classifier store; ``(token_attr (T, n), target_attr (T, m))`` per row
    of a generation store."""
    import torch

    chosen = range(table.num_rows) if rows is None else rows
    if "token_attr" in table.column_names:
        token, target = table.column("token_attr").to_pylist(), table.column("target_attr").to_pylist()
        outputs, inputs = table.column("output_tokens").to_pylist(), table.column("input_tokens").to_pylist()
        columns = table.column("target_attr_tokens").to_pylist()
        return [(torch.tensor(token[i], dtype=torch.float32).reshape(len(outputs[i]), len(inputs[i])),
                 torch.tensor(target[i], dtype=torch.float32).reshape(len(outputs[i]), len(columns[i])))
                for i in chosen]
    maps, shapes = table.column("map").to_pylist(), table.column("map_shape").to_pylist()
    return [torch.tensor(maps[i], dtype=torch.float32).reshape(shapes[i]) for i in chosen]
