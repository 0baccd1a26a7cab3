"""A corpus store held for browsing: the light columns in memory, the maps read on demand.

Opening a store checks its manifest and every shard (as ``read_store`` does) but reads only the
columns a list needs (row id, class, score, tokens or prompt and answer), so 100k rows of
image maps open in seconds and take little memory. A query filters (a case-insensitive
substring of the row's text, an explained class), sorts (row id, class, score, length; ties by
row id) and pages; each sort's order over all rows is computed once and kept. A row's map
comes from its shard, read when asked (the last few shards are kept).

Example::

    >>> index = StoreIndex("digits_store")
    >>> index.query(sort="score", order="desc", limit=5)["rows"][0]["row_id"]
    >>> index.row(17)["map"]["shape"]
"""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np

from ....corpus.store import finished, read_manifest, shard_path, shard_plan
from ....errors import InputError

SORTS = ("row_id", "target", "score", "length")
ORDERS = ("asc", "desc")
MAX_LIMIT = 500
PREVIEW = 160  # characters of a row's text in a list
SHARDS_KEPT = 4


class StoreIndex:
    """The rows of the store ``out`` for the store page (see the module docstring)."""

    def __init__(self, out) -> None:
        import pyarrow.parquet as pq

        self.out = Path(out).expanduser()
        self.manifest = read_manifest(self.out)
        self.kind = self.manifest.get("kind", "classifier")
        self.plan = shard_plan(self.manifest["rows"], self.manifest["shard_rows"])
        missing = [shard for shard, start, stop in self.plan if not finished(self.out, shard, start, stop)]
        if missing:
            raise InputError(f"--store {str(self.out)!r} is not finished: {len(missing)} of {len(self.plan)} shards "
                             f"are missing or damaged (first: {missing[:5]}); run the job's command again first.")
        light = ["row_id", "target", "score", "tokens"] if self.kind == "classifier" else \
            ["row_id", "prompt", "output_tokens", "scores"]
        texts, targets, scores, lengths = [], [], [], []
        for shard, _, _ in self.plan:
            table = pq.read_table(shard_path(self.out, shard), columns=light)
            if self.kind == "classifier":
                tokens = table.column("tokens").to_pylist()
                texts.extend(" ".join(t) if t is not None else "" for t in tokens)
                lengths.extend(len(t) if t is not None else 0 for t in tokens)
                targets.extend(table.column("target").to_pylist())
                scores.extend(table.column("score").to_pylist())
            else:
                outputs = table.column("output_tokens").to_pylist()
                texts.extend(f"{prompt} → {' '.join(answer)}"
                             for prompt, answer in zip(table.column("prompt").to_pylist(), outputs))
                lengths.extend(len(answer) for answer in outputs)
                targets.extend([-1] * table.num_rows)
                scores.extend(float(np.mean(s)) if s else 0.0 for s in table.column("scores").to_pylist())
        self.rows = len(texts)
        self.texts = texts
        self._lower = [text.lower() for text in texts]
        self.keys = {"row_id": np.arange(self.rows), "target": np.asarray(targets, dtype=np.int64),
                     "score": np.asarray(scores, dtype=np.float64), "length": np.asarray(lengths, dtype=np.int64)}
        self.targets = sorted(set(targets)) if self.kind == "classifier" else []
        self.has_text = self.kind == "generation" or any(texts)  # an image store has no tokens to show or sort by
        self._orders: Dict[tuple, np.ndarray] = {}
        self._searched: tuple = (None, None)
        self._shards: "OrderedDict[int, Any]" = OrderedDict()
        self.name = f"{self.out.name} ({self.rows} rows, {self.manifest['method']})"

    def session(self) -> Dict[str, Any]:
        shown = ("kind", "method", "model_class", "dtype", "rows", "target", "score", "max_new_tokens",
                 "captum_transformers", "torch", "transformers")
        sorts = [name for name in SORTS if self.has_text or name != "length"]
        return {"page": "store", "name": self.name, "kind": self.kind, "rows": self.rows, "sorts": sorts,
                "has_text": self.has_text,
                "targets": self.targets, "max_limit": MAX_LIMIT,
                "manifest": {key: self.manifest[key] for key in shown if key in self.manifest}}

    def _order(self, sort: str, order: str) -> np.ndarray:
        if (sort, order) not in self._orders:
            key = self.keys[sort]
            rows = self.keys["row_id"]
            self._orders[(sort, order)] = np.lexsort((rows, -key if order == "desc" else key))
        return self._orders[(sort, order)]

    def _matches(self, text: str) -> Optional[np.ndarray]:
        if not text:
            return None
        if self._searched[0] != text:
            needle = text.lower()
            self._searched = (text, np.fromiter((needle in row for row in self._lower), dtype=bool, count=self.rows))
        return self._searched[1]

    def query(self, q: str = "", sort: str = "row_id", order: str = "asc", target: Optional[int] = None,
              offset: int = 0, limit: int = 50) -> Dict[str, Any]:
        """The page ``offset..offset+limit`` of the rows matching ``q`` and ``target``, sorted."""
        if sort not in SORTS:
            raise InputError(f"sort={sort!r}: expected one of {', '.join(SORTS)}.")
        if order not in ORDERS:
            raise InputError(f"order={order!r}: expected asc or desc.")
        if not isinstance(offset, int) or offset < 0 or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
            raise InputError(f"offset={offset!r}, limit={limit!r}: expected offset >= 0 and 1 <= limit <= {MAX_LIMIT}.")
        if len(q) > 200:
            raise InputError(f"a search of {len(q)} characters: at most 200.")
        ordered = self._order(sort, order)
        keep = self._matches(q)
        if target is not None:
            by_target = self.keys["target"] == target
            keep = by_target if keep is None else keep & by_target
        if keep is not None:
            ordered = ordered[keep[ordered]]
        page = ordered[offset:offset + limit]
        return {"matched": int(len(ordered)), "offset": offset, "limit": limit,
                "rows": [self._summary(int(i)) for i in page]}

    def _summary(self, i: int) -> Dict[str, Any]:
        text = self.texts[i]
        return {"row_id": i, "target": int(self.keys["target"][i]) if self.kind == "classifier" else None,
                "score": float(self.keys["score"][i]), "length": int(self.keys["length"][i]),
                "text": text if len(text) <= PREVIEW else text[:PREVIEW - 1] + "…"}

    def _shard(self, shard: int):
        import pyarrow.parquet as pq

        if shard not in self._shards:
            self._shards[shard] = pq.read_table(shard_path(self.out, shard))
            while len(self._shards) > SHARDS_KEPT:
                self._shards.popitem(last=False)
        self._shards.move_to_end(shard)
        return self._shards[shard]

    def row(self, row_id: int) -> Dict[str, Any]:
        """Row ``row_id`` whole: its summary and its map (an image map as a 2-D grid, channels
        summed; a text map per token; a generation's matrices)."""
        if isinstance(row_id, bool) or not isinstance(row_id, int) or not 0 <= row_id < self.rows:
            raise InputError(f"row {row_id!r}: expected a row id from 0 to {self.rows - 1}.")
        shard = row_id // self.manifest["shard_rows"]
        record = self._shard(shard).slice(row_id - self.plan[shard][1], 1).to_pylist()[0]
        detail = {**self._summary(row_id), "text": self.texts[row_id]}
        if self.kind == "generation":
            inputs, outputs, columns = record["input_tokens"], record["output_tokens"], record["target_attr_tokens"]
            token_attr = np.asarray(record["token_attr"], dtype=np.float64).reshape(len(outputs), len(inputs))
            target_attr = np.asarray(record["target_attr"], dtype=np.float64).reshape(len(outputs), len(columns))
            return {**detail, "prompt": record["prompt"], "input_tokens": inputs, "output_tokens": outputs,
                    "target_attr_tokens": columns, "token_attr": token_attr.tolist(),
                    "target_attr": target_attr.tolist(), "scores": record["scores"],
                    "output_probs": record["output_probs"]}
        values = np.asarray(record["map"], dtype=np.float64).reshape(record["map_shape"])
        if record["tokens"] is not None:
            return {**detail, "tokens": record["tokens"], "map": {"shape": list(values.shape),
                                                                  "values": values.reshape(-1).tolist()}}
        grid = values
        while grid.ndim > 2:
            grid = grid.sum(axis=0)  # (C, H, W) -> (H, W): the channels' total per pixel
        if grid.ndim == 1:
            grid = grid[None]
        return {**detail, "tokens": None, "map": {"shape": list(values.shape), "grid": grid.tolist()}}
