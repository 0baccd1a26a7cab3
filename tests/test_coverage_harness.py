"""The coverage harness (benchmarks/coverage_harness.py): a fast subset of its sweep, and proof
that its checks can fail.

The subset: Llama, BERT and GPT-2 under the causal-LM and sequence-classification heads, three
methods; raw attention and GenericAttention equal their eager references, ConservativeLRP passes
every consistency check. Then fake methods that return a wrong map, change the model, depend on
the batch, return a silent all-zero map or raise get the verdict they deserve; the sweep resumes
from its JSON file (in process, and once through a worker subprocess); the table renders.
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.coverage import harness, shrink, sweep, table  # noqa: E402
from benchmarks.coverage.entries import Entry, enumerate_entries  # noqa: E402
from captum_transformers import RawAttention  # noqa: E402
from captum_transformers.errors import InputError, NotSoftmaxAttentionError  # noqa: E402

SUBSET = ("llama", "bert", "gpt2")
HEADS = ("causal-lm", "sequence-classification")
METHODS = ("raw-attention", "generic-attention", "conservative-lrp")


@pytest.fixture(scope="module")
def subset_verdicts():
    """{(model type, head): {method: Verdict}} of the fast subset, judged in process."""
    verdicts = {}
    for entry in enumerate_entries(HEADS, SUBSET):
        verdicts[(entry.model_type, entry.head)] = dict(
            (name, value) for name, value in harness.run_entry(entry, METHODS, method_timeout=60) if name != "info")
    return verdicts


def test_the_subset_is_enumerated_from_the_auto_mappings(subset_verdicts):
    assert set(subset_verdicts) == {(m, h) for m in SUBSET for h in HEADS}


@pytest.mark.parametrize("model_type", SUBSET)
@pytest.mark.parametrize("head", HEADS)
def test_subset_verdicts(subset_verdicts, model_type, head):
    verdicts = subset_verdicts[(model_type, head)]
    details = {name: (v.kind, v.detail) for name, v in verdicts.items()}
    assert verdicts["raw-attention"].kind == "reference", details
    assert verdicts["generic-attention"].kind == "reference", details
    assert verdicts["conservative-lrp"].kind == "consistent", details


@pytest.fixture(scope="module")
def bert():
    """BERT's sequence classifier, prepared (model, batch, references)."""
    prepared, verdict = harness.prepare(Entry("bert", "sequence-classification", "BertForSequenceClassification"))
    assert verdict is None
    return prepared


class Fake:
    """A method whose ``attribute`` is RawAttention's, then ``after(maps, model, inputs)``."""

    def __init__(self, model, after):
        self.model, self.inner, self.after = model, RawAttention(model), after

    def attribute(self, inputs, target=None, forward_kwargs=None):
        maps = self.inner.attribute(inputs, target=target, forward_kwargs=forward_kwargs)
        return self.after(maps, self.model, inputs)


def judge_fake(prepared, after):
    return harness.judge(prepared.model, prepared.example, lambda model: Fake(model, after),
                         prepared.references["raw-attention"])


def test_the_real_method_matches_its_reference(bert):
    assert judge_fake(bert, lambda maps, model, inputs: maps).kind == "reference"


def test_a_wrong_map_is_not_reference(bert):
    def shifted(maps, model, inputs):
        wrong = maps.clone()
        wrong[:, 1] += 1e-3 * (wrong[:, 1] != 0)  # padding and the consistency checks untouched
        return wrong

    verdict = judge_fake(bert, shifted)
    assert verdict.kind == "failed" and "differs from the eager reference" in verdict.detail


def test_a_map_within_float32_rounding_only_is_consistent_not_reference(bert):
    def rounded(maps, model, inputs):
        return maps + 1e-8 * (maps != 0)

    verdict = judge_fake(bert, rounded)
    assert verdict.kind == "consistent" and "float32" in verdict.detail


def _add_to_a_weight(maps, model, inputs):
    with torch.no_grad():
        next(model.parameters()).add_(1e-3)
    return maps


def _leave_a_hook(maps, model, inputs):
    model.register_forward_hook(lambda *args: None)
    return maps


@pytest.mark.parametrize("mutation, expected", [(_add_to_a_weight, "state_dict changed"),
                                                (_leave_a_hook, "hooks changed")])
def test_a_method_that_changes_the_model_is_caught(mutation, expected):
    prepared, _ = harness.prepare(Entry("bert", "sequence-classification", "BertForSequenceClassification"))
    verdict = judge_fake(prepared, mutation)
    assert verdict.kind == "failed" and expected in verdict.detail


def test_a_batch_dependent_map_is_caught(bert):
    verdict = judge_fake(bert, lambda maps, model, inputs: maps * inputs.shape[0])
    assert verdict.kind == "failed" and "!= single call" in verdict.detail


def test_a_silent_all_zero_map_is_caught(bert):
    verdict = judge_fake(bert, lambda maps, model, inputs: torch.zeros_like(maps))
    assert verdict.kind == "failed" and "all zero, without a warning" in verdict.detail


def test_a_raw_exception_is_failed_and_a_package_error_refused(bert):
    def raw(maps, model, inputs):
        raise ZeroDivisionError("boom")

    def refusal(maps, model, inputs):
        raise InputError("not this one\nsecond line")

    failed = judge_fake(bert, raw)
    assert failed.kind == "failed" and failed.detail == "ZeroDivisionError: boom"
    assert "test_coverage_harness.py" in failed.origin
    refused = judge_fake(bert, refusal)
    assert refused.kind == "refused" and refused.detail == "not this one"


def test_a_method_whose_definition_does_not_apply_is_not_applicable_and_left_out_of_the_percentages(bert):
    def not_softmax(maps, model, inputs):
        raise NotSoftmaxAttentionError("a scan, not softmax attention")

    verdict = judge_fake(bert, not_softmax)
    assert verdict.kind == "not applicable" and verdict.detail == "a scan, not softmax attention"
    cells = {"a": {"kind": "reference"}, "b": {"kind": "not applicable"}}
    records = [{"cells": cells}, {"cells": {"a": {"kind": "consistent"}, "b": {"kind": "refused"}}},
               {"cells": {"a": {"kind": "not applicable"}, "b": {"kind": "not applicable"}}}]
    counted = table.totals(records, ["a", "b"])
    assert counted["applicable"] == 3 and round(counted["explained %"], 6) == round(200 / 3, 6)
    assert counted["whole"] == 1 and counted["building"] == 3  # all-n.a. and refused rows are not explained


def test_a_method_past_its_time_limit_is_timed_out(bert):
    def slow(maps, model, inputs):
        while True:
            pass

    with harness.time_limit(0.2):
        verdict = judge_fake(bert, slow)
    assert verdict.kind == "timed out"


def test_per_layer_lists_keep_each_kind_of_layer():
    layers = ["sliding"] * 5 + ["full"] + ["sliding"] * 5 + ["full"]
    assert shrink.cut_layer_list(layers) == ["sliding", "full"]
    assert shrink.cut_layer_list(["a", "a", "a"]) == ["a", "a"]


def test_the_sweep_resumes_and_the_table_renders(tmp_path):
    out = str(tmp_path / "results.json")
    entries = enumerate_entries(["sequence-classification"], ["bert"])
    sweep.sweep(entries, ["raw-attention"], out, in_process=True, log=lambda *_: None)
    messages = []
    results = sweep.sweep(entries, ["raw-attention"], out, in_process=True, log=messages.append)
    assert messages == ["0 of 1 entries to run, 1 methods"]
    with open(out) as handle:
        cells = json.load(handle)["entries"]["bert/sequence-classification"]["cells"]
    assert cells["raw-attention"]["kind"] == "reference"
    page = table.render(results)
    assert f"transformers {results['transformers']}" in page
    assert "| `bert` (BertForSequenceClassification) | ref |" in page


def test_a_worker_subprocess_fills_the_results(tmp_path):
    out = str(tmp_path / "results.json")
    entries = enumerate_entries(["sequence-classification"], ["bert"])
    results = sweep.sweep(entries, ["raw-attention", "rollout"], out, log=lambda *_: None)
    cells = results["entries"]["bert/sequence-classification"]["cells"]
    assert cells["raw-attention"]["kind"] == "reference" and cells["rollout"]["kind"] == "consistent"


def test_refusal_messages_group_without_class_names_and_numbers():
    first = "LlamaForCausalLM has no config.pad_token_id, got 3 tokens"
    second = "GPT2LMHeadModel has no config.pad_token_id, got 17 tokens"
    assert table.reason_key(first) == table.reason_key(second)


def test_the_event_reader_waits_for_complete_lines(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_bytes('{"detail": "auto\u2011handled"}\n{"b"'.encode())
    reader = sweep.EventReader(str(path))
    assert reader.new_events() == [{"detail": "auto\u2011handled"}]
    with open(path, "ab") as handle:
        handle.write(b': 2}\n')
    assert reader.new_events() == [{"b": 2}]


@pytest.mark.parametrize("code, kind", [(-9, "failed"), ("killed", "timed out")])
def test_a_dead_or_stalled_worker_closes_its_entry(tmp_path, code, kind):
    entry = Entry("bert", "sequence-classification", "BertForSequenceClassification")
    results = {"entries": {}}
    sweep._after_worker(code, entry.key, results, {entry.key: entry}, ["raw-attention"], 10, str(tmp_path),
                        lambda *_: None)
    assert results["entries"][entry.key]["cells"]["raw-attention"]["kind"] == kind


def test_maps_that_are_no_probabilities_get_no_reference():
    from benchmarks.coverage.reference import non_probability_layers

    softmax = torch.softmax(torch.randn(2, 4, 5, 5, dtype=torch.float64), dim=-1)
    linear = softmax - 0.1  # a linear-attention layer's weights: rows do not sum to 1
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, 3:] = 0
    assert non_probability_layers([softmax, linear, softmax], mask) == [1]


def test_a_redo_forgets_only_the_cells_of_the_entries_swept():
    results = {"entries": {"a/causal-lm": {"cells": {"x": {"kind": "failed"}, "y": {"kind": "consistent"}}},
                           "b/causal-lm": {"cells": {"x": {"kind": "failed"}}}}}
    assert sweep.forget(results, ["failed"], ["a/causal-lm"]) == ["a/causal-lm"]
    assert set(results["entries"]["a/causal-lm"]["cells"]) == {"y"}
    assert results["entries"]["b/causal-lm"]["cells"] == {"x": {"kind": "failed"}}
    assert sweep.forget(results, ["failed"]) == ["b/causal-lm"]
