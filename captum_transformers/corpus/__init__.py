"""Explain a whole corpus: a resumable job, sharded over processes, written to Parquet.

``explain_dataset(model, source, method, out)`` explains every row of a :class:`CorpusSource`
(:func:`digit_canvas_source`, :func:`table_source`) with one method and writes the maps to a
store of atomically written Parquet shards with a manifest (:mod:`.store`); under ``torchrun``
each process takes every ``WORLD_SIZE``-th shard. ``read_store(out)`` checks and reads it.
The command line is ``captum-transformers attribute``.
"""
from .job import CorpusRun, explain_dataset, weights_sha256
from .sources import CorpusSource, digit_canvas_source, table_source
from .store import SCHEMA_DOC, read_store, rows_to_maps

__all__ = ["CorpusRun", "CorpusSource", "SCHEMA_DOC", "digit_canvas_source", "explain_dataset", "read_store",
           "rows_to_maps", "table_source", "weights_sha256"]
