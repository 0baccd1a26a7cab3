"""``benchmark --task recall``: evidence ranks and shares on hand-made scores, percentile bootstrap
intervals on hand cases, and a small run of the command on the shipped recall Llama."""
import json
import math

import pytest
import torch

from captum_transformers.cli import main
from captum_transformers.errors import InputError
from captum_transformers.evaluation.results import write_csv, write_json
from captum_transformers.tasks.bootstrap import bootstrap_interval
from captum_transformers.tasks.recall.benchmark import (evidence_positions, evidence_rows, evidence_scores,
                                                        resolve_recall_methods, run_recall_benchmark)
from captum_transformers.tasks.recall.task import recall_examples

pytest.importorskip("transformers")


# -- bootstrap ----------------------------------------------------------------------------------
def test_bootstrap_of_two_values_spans_both():
    # Resample means of [0, 1] are 0, 0.5, 1 with chances 1/4, 1/2, 1/4: the 2.5 % and 97.5 %
    # quantiles are 0 and 1.
    interval = bootstrap_interval([0.0, 1.0], name="hits")
    assert (interval.name, interval.value, interval.low, interval.high, interval.count) == ("hits", 0.5, 0.0, 1.0, 2)


def test_bootstrap_hand_case_with_a_narrow_level():
    # [0, 0, 1]: means 0, 1/3, 2/3, 1 with chances 8/27, 12/27, 6/27, 1/27. The 40 % and 60 %
    # quantiles fall inside the 1/3 mass (cumulative 8/27 = 0.30 to 20/27 = 0.74).
    interval = bootstrap_interval([0.0, 0.0, 1.0], level=0.2, resamples=4000)
    assert interval.value == pytest.approx(1 / 3)
    assert interval.low == pytest.approx(1 / 3) and interval.high == pytest.approx(1 / 3)
    wide = bootstrap_interval([0.0, 0.0, 1.0], resamples=20000)
    assert (wide.low, wide.high) == (0.0, 1.0)  # P(mean = 1) = 1/27 > 2.5 %


def test_bootstrap_is_seeded_constant_values_give_a_point_and_nan_is_excluded():
    values = torch.linspace(0, 1, 50)
    assert bootstrap_interval(values, seed=3) == bootstrap_interval(values, seed=3)
    assert bootstrap_interval(values, seed=3) != bootstrap_interval(values, seed=4)
    assert bootstrap_interval([0.7] * 5).text == "0.700 [0.700, 0.700]"
    kept = bootstrap_interval([float("nan"), 1.0, 0.0, float("nan")])
    assert (kept.count, kept.excluded, kept.value) == (2, 2, 0.5)
    empty = bootstrap_interval([float("nan")])
    assert empty.count == 0 and math.isnan(empty.value) and math.isnan(empty.high)


@pytest.mark.parametrize("kwargs, message", [({"values": [1.0, float("inf")]}, "infinite"),
                                             ({"values": [1.0], "level": 1.0}, "level"),
                                             ({"values": [1.0], "resamples": 0}, "resamples")])
def test_bootstrap_refuses_bad_input(kwargs, message):
    with pytest.raises(InputError, match=message):
        bootstrap_interval(**kwargs)


# -- evidence ranks and shares ------------------------------------------------------------------
def test_ranks_and_shares_of_a_hand_made_attribution():
    # Two prompts of 5 and 4 tokens, two answer words each; evidence (value, key, query).
    scores = torch.tensor([[[0.0, 0.1, 0.6, 0.3, 0.0], [0.0, 0.5, 0.4, 0.5, -1.0]],
                           [[2.0, 2.0, 2.0, 2.0, 0.0], [-1.0, -2.0, 0.0, 0.0, 9.0]]], dtype=torch.float64)
    lengths = torch.tensor([5, 4])
    evidence = torch.tensor([[[2, 1, 4], [3, 1, 4]], [[1, 0, 3], [2, 0, 3]]])
    out = evidence_scores(scores, lengths, evidence)
    # Ties count against the method: 0.5 ties 0.5 (rank 2); a constant row ranks its evidence last;
    # the 9.0 past prompt 2's length is not read.
    assert out.value_rank.tolist() == [[1, 2], [4, 2]]
    assert out.key_rank.tolist() == [[3, 2], [4, 3]]
    assert out.query_rank.tolist() == [[5, 5], [4, 2]]
    assert out.value_share[0].tolist() == pytest.approx([0.6, 0.5 / 1.4])
    assert out.value_share[1, 0] == pytest.approx(0.25)
    assert math.isnan(out.value_share[1, 1])  # no positive score in the row: undefined
    assert out.evidence_share[0, 0] == pytest.approx(0.7)
    rows = {r.name: r for r in evidence_rows(out, top_k=2)}
    assert rows["top1_value"].value == pytest.approx(0.25)  # prompt means 0.5 and 0
    assert rows["top2_value"].value == pytest.approx(0.75)  # prompt means 1 and 0.5
    assert rows["top1_key"].value == 0.0
    assert rows["top1_value_word1"].value == 0.5 and rows["top1_value_word2"].value == 0.0
    # Shares: prompt 1 the mean of its two words, prompt 2 its one defined word.
    assert rows["share_value"].value == pytest.approx(((0.6 + 0.5 / 1.4) / 2 + 0.25) / 2)
    assert rows["share_value"].excluded == 0 and rows["share_value"].count == 2


@pytest.mark.parametrize("scores, hit", [([0.9, 0.1, 0.5, 0.2, 0.9], False), ([0.5, 0.1, 0.5, 0.2, 0.0], False),
                                         ([0.4, 0.1, 0.2, 0.5, 0.0], True)])
def test_a_record_hit_needs_a_record_token_strictly_above_the_rest(scores, hit):
    # Record: the value (2), the key (1) and the query (3); positions 0 and 4 are outside it.
    out = evidence_scores(torch.tensor([[scores]]), torch.tensor([5]), torch.tensor([[[2, 1, 3]]]))
    assert out.record_hit.tolist() == [[hit]]


def test_evidence_scores_refuse_positions_outside_the_prompt():
    with pytest.raises(InputError, match="outside its prompt"):
        evidence_scores(torch.zeros(1, 1, 4), torch.tensor([3]), torch.tensor([[[3, 1, 2]]]))


def test_evidence_positions_follow_the_task():
    examples = recall_examples(3, seed=0, split="test")
    positions = evidence_positions(examples)
    assert positions.shape == (3, 2, 3)
    for example, rows in zip(examples, positions.tolist()):
        assert [example.prompt_ids[value] for value, _, _ in rows] == example.answer_ids[:2]


def test_unknown_methods_and_explain_predicted_are_refused():
    with pytest.raises(InputError, match="unknown method 'nope'"):
        resolve_recall_methods(["nope"])
    with pytest.raises(InputError, match="teacher-forced"):
        run_recall_benchmark(["rollout"], limit=2, explain="predicted")


# -- the command ----------------------------------------------------------------------------------
def test_recall_benchmark_on_eight_prompts_prints_and_writes_the_table(tmp_path, capsys):
    methods = ["conservative-lrp", "rollout", "llm-feature-ablation"]
    assert main(["benchmark", "--task", "recall", "--limit", "8", "--methods", *methods, "--no-progress",
                 "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "task recall: 8 test examples, 3 methods" in printed
    assert all(f"| {name} |" in printed for name in methods) and "top-3 value hit" in printed
    rows = json.loads((tmp_path / "results.json").read_text())
    by_key = {(row["method"], row["name"]): row for row in rows}
    # The shipped model copies each answer word; ConservativeLRP's top token is that word (64 / 64
    # in benchmarks/recall_evidence.py); rollout follows the query-key match, never the value.
    assert by_key[("conservative-lrp", "top1_value")]["value"] == 1.0
    assert by_key[("rollout", "top1_value")]["value"] == 0.0
    assert by_key[("conservative-lrp", "top1_record")]["value"] == 1.0
    assert all(-1.0 <= by_key[(name, "srg")]["value"] <= 1.0 for name in methods)
    for (method, name), row in by_key.items():
        if row["kind"] == "IntervalResult":
            assert row["low"] <= row["value"] <= row["high"] and row["count"] == 8, (method, name)
        else:
            assert name == "ms_per_token" and row["value"] > 0 and row["count"] == 16
    assert "share_evidence" in (tmp_path / "results.csv").read_text()


def test_recall_rows_write_through_the_shared_writers(tmp_path):
    report = run_recall_benchmark(["attn-lrp"], limit=2)
    write_json(report.rows, tmp_path / "r.json")
    write_csv(report.rows, tmp_path / "r.csv")
    assert report.result("attn-lrp", "top3_value").count == 2 and report.examples == 2
