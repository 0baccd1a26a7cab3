"""The coverage harness's vision-audio suite (``benchmarks/coverage_harness.py --suite
vision-audio``): a fast subset of its sweep, and proof that its rows check can fail.

The subset: ViT (CLS head), BEiT (mean-pooling head), wav2vec2 (a mean over frames, maps onto the
waveform) and ResNet (a CNN) under the image and audio classification heads. The attention
methods are consistent on the transformers, and raw attention and rollout explain the rows the head
reads; every attention method is `not applicable` on the CNN, with one named reason. Then a
raw attention made to read the CLS row of BEiT's mean-pooling head fails the rows check.
"""
from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.coverage import harness, media, table  # noqa: E402
from benchmarks.coverage.entries import SUITES, Entry, enumerate_entries  # noqa: E402
from benchmarks.coverage.inputs import explained_scores  # noqa: E402
from captum_transformers import RawAttention  # noqa: E402
from captum_transformers.adapters.huggingface.adapter import HuggingFaceAdapter  # noqa: E402

SUBSET = ("vit", "beit", "resnet", "wav2vec2")
METHODS = ("raw-attention", "rollout", "attn-lrp", "integrated-gradients")


@pytest.fixture(scope="module")
def verdicts():
    found = {}
    for entry in enumerate_entries(SUITES["vision-audio"]["heads"], SUBSET):
        found[entry.model_type] = dict(
            (name, value) for name, value in harness.run_entry(entry, METHODS, method_timeout=120) if name != "info")
    return found


def test_the_subset_is_enumerated_from_both_auto_mappings(verdicts):
    assert set(verdicts) == set(SUBSET)


@pytest.mark.parametrize("model_type", ["vit", "beit", "wav2vec2"])
def test_transformers_are_explained_and_read_the_heads_rows(verdicts, model_type):
    found = {name: (v.kind, v.detail) for name, v in verdicts[model_type].items()}
    assert all(kind == "consistent" for kind, _ in found.values()), found
    assert found["raw-attention"][1] == found["rollout"][1] == "rows = the head's", found


def test_a_cnn_is_not_applicable_to_the_attention_methods(verdicts):
    found = verdicts["resnet"]
    for name in ("raw-attention", "rollout", "attn-lrp"):
        assert found[name].kind == "not applicable" and "has no attention layer" in found[name].detail
    assert found["integrated-gradients"].kind == "consistent"


def test_the_rows_check_fails_a_method_reading_the_cls_row_of_a_mean_pooling_head():
    prepared, verdict = harness.prepare(Entry("beit", "image-classification", "BeitForImageClassification"))
    assert verdict is None and prepared.model.config.use_mean_pooling
    example = prepared.example

    def score(output):
        return explained_scores(output, example)

    right = RawAttention(prepared.model)
    assert media.read_rows_problem(prepared.model, right, example, score) == (None, "rows = the head's")
    wrong = RawAttention(prepared.model, adapter=HuggingFaceAdapter(query_rows=0))
    problem, _ = media.read_rows_problem(prepared.model, wrong, example, score)
    assert problem == "explains row(s) [0] of example 0, but the head reads [1, 2, ..., 16] (16 rows)"


def test_the_page_renders_with_the_vision_audio_header(verdicts):
    results = {"entries": {}}
    for model_type, cells in verdicts.items():
        head = "audio-classification" if model_type == "wav2vec2" else "image-classification"
        results["entries"][f"{model_type}/{head}"] = {
            "model_type": model_type, "head": head, "class": model_type, "info": {},
            "cells": {name: v.as_dict() for name, v in cells.items()}}
    page = table.render(results, heads=SUITES["vision-audio"]["heads"], suite="vision-audio")
    assert page.startswith("# Vision and audio coverage")
    assert "| Image classification | 3 |" in page and "| Audio classification | 1 |" in page
    assert "has no attention layer" in page
