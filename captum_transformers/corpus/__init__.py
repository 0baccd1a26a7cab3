"""Explain a whole corpus: a resumable job, sharded over processes, written to Parquet.

``explain_dataset(model, source, method, out)`` explains every row of a :class:`CorpusSource`
(:func:`digit_canvas_source`, :func:`motif_graph_source`, :func:`table_source`) with one method;
``explain_generations(model, tokenizer, prompts, method, out)`` lets a language model answer
every prompt of a :class:`PromptSource` (:func:`recall_prompt_source`,
:func:`prompt_table_source`) and explains each answer token. Both write a store of atomically
written Parquet shards with a manifest (:mod:`.store`); under ``torchrun`` each process takes
every ``WORLD_SIZE``-th shard. ``read_store(out)`` checks and reads it;
``evaluate_store(out, source, metrics)`` computes the package's metrics from its maps. The command line is
``captum-transformers attribute``.
"""
from .generations import explain_generations, tokenizer_sha256
from .job import CorpusRun, explain_dataset, weights_sha256
from .metrics import evaluate_store
from .sources import (CorpusSource, PromptSource, digit_canvas_source, motif_graph_source, prompt_table_source,
                      recall_prompt_source, table_source, table_values)
from .store import GENERATION_SCHEMA_DOC, SCHEMA_DOC, read_store, rows_to_maps

__all__ = ["CorpusRun", "CorpusSource", "GENERATION_SCHEMA_DOC", "PromptSource", "SCHEMA_DOC", "digit_canvas_source",
           "evaluate_store", "explain_dataset", "explain_generations", "motif_graph_source", "prompt_table_source",
           "read_store", "recall_prompt_source", "rows_to_maps", "table_source", "table_values", "tokenizer_sha256",
           "weights_sha256"]
