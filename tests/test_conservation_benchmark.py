"""benchmarks/conservation_movie.py's measurement on a tiny bias-free BERT (no movie model):
the identity-activation row conserves, the table has one row per method and class."""
from __future__ import annotations

import pytest
import torch
from benchmark_scripts import load_benchmark_script

transformers = pytest.importorskip("transformers")


def _load():
    return load_benchmark_script("conservation_movie.py", "conservation_movie_benchmark")


def test_measure_and_table_on_a_tiny_bias_free_bert():
    bench = _load()
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=99,
        num_labels=2, attn_implementation="eager")).double().eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.zero_()
        model.classifier.weight.mul_(30)
    ids = torch.randint(3, 99, (4, 6), generator=torch.Generator().manual_seed(1))
    batches = [{"input_ids": ids[:2], "attention_mask": torch.ones(2, 6, dtype=torch.long)},
               {"input_ids": ids[2:], "attention_mask": torch.tensor([[1] * 6, [1] * 4 + [0] * 2])}]
    results = bench.measure(model, batches, lambda out: out.argmax(-1))
    sums, deltas, logits = results['ConservativeLRP AH+LN, activation_rule="identity"']
    assert sums.shape == logits.shape == (4,)
    torch.testing.assert_close(sums, logits, rtol=1e-9, atol=1e-12)
    assert deltas.abs().max() < 1e-9
    default_sums, _, _ = results["ConservativeLRP AH+LN (default)"]
    assert (default_sums - logits).abs().max() > 1e-4   # GELU and tanh under the plain gradient
    table = bench.rows(results, "predicted")
    assert len(table) == 3 and all(line.startswith("| predicted | ") for line in table)
    assert "| 100% |" in table[1]
