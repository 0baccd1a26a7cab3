"""Where a corpus job's rows come from: a :class:`CorpusSource` gives the number of rows, a
fingerprint of its content (kept in the store's manifest, so a resumed run reads the same
data) and the model inputs of any run of rows.

Classifier jobs read a :class:`CorpusSource`: :func:`digit_canvas_source` (the built-in
DigitCanvas split, generated deterministically) or :func:`table_source` (a column of a table,
:func:`table_values`: a Parquet file or folder, a JSON-lines file, or a ``datasets`` dataset
saved to disk; raw values turned into model inputs by ``prepare``, e.g. the texts a tokenizer
reads). Generation jobs read a :class:`PromptSource`: :func:`recall_prompt_source` (the
built-in recall task's prompts) or :func:`prompt_table_source` (a column of prompts). Rows are
numbered 0..N-1 in the source's order; that number is the ``row_id`` of the store.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import InputError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
#: ``prepare(values) -> (inputs, forward_kwargs, displays)``: one batch of model inputs from a list of
#: raw values (``LoadedModel.prepare``'s contract); ``displays`` are per-row tokens (text) or anything else.
Prepare = Callable[[List[Any]], Tuple[Tuple[torch.Tensor, ...], Dict[str, Any], list]]


@dataclass
class CorpusSource:
    """``rows`` examples, ``batch(start, stop)`` the model inputs of rows ``start..stop-1``:
    ``(inputs, forward_kwargs, tokens or None)``; ``fingerprint`` names the content exactly.

    The model is called ``model(*inputs, **forward_kwargs)``; the first ``explained`` inputs
    are explained, the others passed on as Captum's ``additional_forward_args`` (a graph's
    ``edge_index`` and ``batch``). ``row_maps(maps, inputs, forward_kwargs)``, when given,
    cuts a batch's maps into one tensor per row (a graph's nodes); by default row ``i`` is
    ``maps[i]``, its padding dropped where an attention mask marks it. ``token_maps``: read
    token scores (``return_tokens=True``); None: for text and token ids, not for images.
    ``value_kind``: what the rows are ("image", "text", "graph" or "" unknown), so a loader can
    refuse data of the other modality and a metric be fed its inputs."""

    rows: int
    fingerprint: str
    load: Callable[[int, int], Tuple[Tuple[torch.Tensor, ...], Dict[str, Any], Optional[List[List[str]]]]]
    description: str = ""
    labels: Optional[torch.Tensor] = field(default=None, repr=False)
    explained: int = 1
    row_maps: Optional[Callable[[torch.Tensor, tuple, dict], List[torch.Tensor]]] = field(default=None, repr=False)
    token_maps: Optional[bool] = None
    value_kind: str = ""

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


def motif_graph_source(rows: int, seed: Optional[int] = None) -> CorpusSource:
    """``rows`` BA-2Motifs test graphs of the built-in motif task (the motif transformer's
    inputs, PyG's flat form: node features, ``edge_index``, ``batch``), generated once; each
    row's map is its nodes' scores."""
    from ..adapters.graph.nodes import GraphBatch
    from ..tasks.motifs.graphs import motif_graphs
    from ..tasks.motifs.train import TEST_SEED

    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        raise InputError(f"a motif graph source needs at least 1 row, received rows={rows!r}.")
    seed = TEST_SEED if seed is None else seed
    graphs = motif_graphs(rows, seed=seed)

    def load(start, stop):
        part = graphs.graphs(start, stop)
        return (part.x, part.edge_index, part.batch), {}, None

    def row_maps(maps, inputs, forward_kwargs):
        nodes = GraphBatch.of(inputs[2].cpu(), inputs[0].shape[0])
        return [maps[graph, :int(count)] for graph, count in enumerate(nodes.counts)]

    return CorpusSource(rows, f"motif-graphs:n={rows}:seed={seed}", load, f"{rows} BA-2Motifs test graphs",
                        graphs.labels, explained=1, row_maps=row_maps, token_maps=True, value_kind="graph")


def table_source(path, prepare: Prepare, column: str = "text") -> CorpusSource:
    """The values of ``column`` of a table (:func:`table_values`: Parquet, JSON lines, or a
    ``datasets`` dataset saved to disk), in file order, turned into model inputs a batch at a
    time by ``prepare``."""
    values, fingerprint, description = table_values(path, column)
    kind = "image" if _is_image(values[0]) else "text" if isinstance(values[0], str) else ""

    def load(start, stop):
        inputs, forward_kwargs, displays = prepare([_opened(value) for value in values[start:stop]])
        tokens = displays if displays and isinstance(displays[0], (list, tuple)) else None
        return tuple(inputs), dict(forward_kwargs or {}), tokens

    return CorpusSource(len(values), fingerprint, load, description, value_kind=kind)


def _is_image(value: Any) -> bool:
    return isinstance(value, Path) or (isinstance(value, dict) and isinstance(value.get("bytes"), bytes))


def _opened(value: Any) -> Any:
    """An image file (a folder's) or an encoded image (``datasets``' Image feature: ``{"bytes",
    "path"}``) as an RGB PIL image; any other value as it is."""
    if not _is_image(value):
        return value
    from ..model_loading import read_image

    if isinstance(value, Path):
        return read_image(str(value))
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(value["bytes"])) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as error:
        raise InputError(f"an encoded image of the data ({value.get('path') or 'no path'}, {len(value['bytes'])} "
                         f"bytes) could not be read ({type(error).__name__}): expected PNG, JPEG or another format "
                         "Pillow reads.") from None


@dataclass
class PromptSource:
    """``rows`` prompts of a generation job; ``prompts(start, stop)`` the texts of rows
    ``start..stop-1``; ``fingerprint`` names the content exactly."""

    rows: int
    fingerprint: str
    texts: Callable[[int, int], List[str]] = field(repr=False)
    description: str = ""

    def prompts(self, start: int, stop: int) -> List[str]:
        if not 0 <= start < stop <= self.rows:
            raise InputError(f"rows {start}..{stop - 1} asked of a source of {self.rows} prompts.")
        return self.texts(start, stop)


def prompt_table_source(path, column: str = "prompt") -> PromptSource:
    """The prompts in ``column`` of a table (:func:`table_values`); every value must be a
    non-empty string."""
    values, fingerprint, description = table_values(path, column)
    for number, value in enumerate(values):
        if not isinstance(value, str) or not value.strip():
            raise InputError(f"row {number} of {description} is {value!r}; a generation job's prompts are non-empty "
                             f"strings (choose the column with --column).")
    return PromptSource(len(values), fingerprint, lambda start, stop: values[start:stop], description)


def recall_prompt_source(rows: int, split: str = "test", seed: int = 0) -> PromptSource:
    """``rows`` associative-recall prompts of ``split`` (the built-in recall Llama's task,
    :mod:`captum_transformers.tasks.recall.task`), generated deterministically."""
    from ..tasks.recall.task import recall_examples

    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        raise InputError(f"a recall prompt source needs at least 1 row, received rows={rows!r}.")
    prompts = [example.prompt for example in recall_examples(rows, seed=seed, split=split)]
    return PromptSource(rows, f"recall-prompts:{split}:n={rows}:seed={seed}", lambda start, stop: prompts[start:stop],
                        f"{rows} associative-recall {split} prompts")


def table_values(path, column: str) -> Tuple[list, str, str]:
    """``(values, fingerprint, description)`` of ``column`` in a Parquet file or folder of
    Parquet files, a JSON-lines file (``.jsonl`` / ``.json``), or a folder written by
    ``datasets.Dataset.save_to_disk`` (read with ``pyarrow``; ``datasets`` is not needed), in
    file order; or the image files of a folder (no column: one row per file, in the order of
    their paths). The fingerprint is the SHA-256 of the data files' bytes and the column's
    name (of an image folder: each file's relative path and bytes). Encoded images in a column
    (``datasets``' Image feature) are opened a batch at a time by :func:`table_source`."""
    path = Path(path).expanduser()
    if not path.exists():
        raise InputError(f"--data {str(path)!r}: no such file or folder; expected a Parquet file or folder, a "
                         "JSON-lines file, or a folder written by datasets' save_to_disk.")
    if path.is_dir() and (path / "dataset_dict.json").exists():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").exists())
        raise InputError(f"--data {str(path)!r} is a datasets DatasetDict (splits {splits}); give one split's "
                         f"folder, e.g. --data {path / (splits[0] if splits else 'train')}.")
    if path.is_dir() and (path / "state.json").exists():
        files = _saved_dataset_files(path)
    else:
        files = sorted(path.rglob("*.parquet")) if path.is_dir() else [path]
    if path.is_dir() and not files:
        images = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        if images:  # a folder of image files: one row per file, in the order of their paths
            digest = hashlib.sha256(b"image-folder")
            for image in images:
                digest.update(str(image.relative_to(path)).encode() + b"\0" + image.read_bytes())
            return images, f"images:sha256={digest.hexdigest()}", f"{len(images)} images in {path}"
    if not files:
        raise InputError(f"--data {str(path)!r} is a folder with no .parquet files and no images "
                         f"({', '.join(IMAGE_SUFFIXES)}).")
    digest = hashlib.sha256(column.encode())
    for file in files:
        digest.update(file.read_bytes())
    values = _column(files, column)
    if not values:
        raise InputError(f"--data {str(path)!r} has no rows.")
    return values, f"table:{column}:sha256={digest.hexdigest()}", f"{len(values)} rows of {column!r} in {path}"


def _saved_dataset_files(folder: Path) -> List[Path]:
    """The Arrow files of a ``save_to_disk`` folder, in the order its ``state.json`` lists them."""
    try:
        state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
        files = [folder / entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise InputError(f"{folder / 'state.json'} is not a datasets save_to_disk state ({error!r}); save the "
                         "dataset again with Dataset.save_to_disk.") from None
    if state.get("_indices_data_files") or (folder / "indices.arrow").exists():
        raise InputError(f"{folder} holds a shuffled or selected view (an indices mapping); save it with "
                         "dataset.flatten_indices().save_to_disk(...) so the rows are stored in order.")
    absent = [str(file) for file in files if not file.exists()]
    if absent:
        raise InputError(f"{folder}: state.json lists data files that are missing: {absent}.")
    return files
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
    if files[0].suffix == ".arrow":
        import pyarrow as pa

        values = []
        for file in files:
            with pa.memory_map(str(file)) as handle:
                table = pa.ipc.open_stream(handle).read_all()
            if column not in table.column_names:
                raise InputError(f"{file} has no column {column!r}; its columns are {table.column_names} "
                                 "(choose one with --column).")
            values.extend(table.column(column).to_pylist())
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
