"""The text-model coverage harness: every architecture of transformers' auto mappings (causal LM,
sequence / token classification, question answering, masked LM, seq2seq LM), built from a
shrunk config with random float64 weights, explained by every method of the package, one
verdict per (architecture, head, method).

Modules:

* :mod:`.entries`: the (model type, head) pairs enumerated from ``modeling_auto``.
* :mod:`.shrink`: the config shrinker (generic rules, and a table of per-family overrides).
* :mod:`.inputs`: the batch (two rows, the second right-padded), its single examples, the target.
* :mod:`.reference`: raw attention and GenericAttention (ICCV'21 Eq. 5-6) from the model's own
  eager ``output_attentions``.
* :mod:`.harness`: the checks and the verdict of one method on one model.
* :mod:`.sweep`: the resumable sweep (worker subprocesses, a JSON results file).
* :mod:`.table`: the Markdown support table (``docs/coverage.md``).

The command line is ``benchmarks/coverage_harness.py``.
"""
