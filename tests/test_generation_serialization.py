"""Generation results to JSON and back (serialization.py) and to inseq's JSON (inseq_export.py).

No inseq here: the inseq file is checked against the layout inseq 0.7 reads (the documented
constants); benchmarks/inseq_roundtrip_check.py loads it with inseq itself.
"""
from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

from captum_transformers import AttnLRP, GenerationAttribution, RawAttention
from captum_transformers.errors import InputError
from captum_transformers.generation import GenerationResult
from captum_transformers.integrations.inseq.export import (INSEQ_OUTPUT_TYPE, INSEQ_SEQUENCE_TYPE, INSEQ_TOKEN_TYPE,
                                                         SEQUENCE_FIELDS, save_inseq_json, tensor_from_safetensor_b64,
                                                         to_inseq_dict)
from captum_transformers.generation.serialization import (ARRAY_FIELDS, SCHEMA, SCORES_SCHEMA, load_scores_json,
                                                          result_from_dict, result_to_dict, save_scores_json)

from generation_models import IdTokenizer, build

PROMPT, TARGET = "1 5 7 9", "3 4 6"


@pytest.fixture(scope="module")
def llama():
    return build("llama")


@pytest.fixture(scope="module")
def single(llama):
    return GenerationAttribution(AttnLRP(llama), IdTokenizer()).attribute(PROMPT, target=TARGET)


@pytest.fixture(scope="module")
def span_contrast(llama):
    return GenerationAttribution(AttnLRP(llama), IdTokenizer(), score="log_prob").attribute(
        PROMPT, target=TARGET, span=[0, 1], contrast="8")


def _through_json(result):
    return result_from_dict(json.loads(json.dumps(result_to_dict(result), allow_nan=False)))


def _assert_same(a: GenerationResult, b: GenerationResult) -> None:
    for field in ARRAY_FIELDS:
        x, y = getattr(a, field), getattr(b, field)
        assert x.dtype == y.dtype and x.shape == y.shape, field
        assert torch.equal(x, y), field  # bit for bit
    for field in ("input_tokens", "output_tokens", "target_attr_tokens", "input_ids", "output_ids", "contrast_tokens",
                  "score_kind", "method", "signed"):
        assert getattr(a, field) == getattr(b, field), field
    assert torch.equal(a.seq_attr, b.seq_attr)


def test_single_result_round_trip_is_exact(single):
    back = _through_json(single)
    _assert_same(single, back)
    assert single.token_attr.dtype == torch.float64 and back.inp is None and back.signed is True
    assert result_to_dict(single)["schema"] == SCHEMA


def test_span_contrast_result_round_trip_is_exact(span_contrast):
    back = _through_json(span_contrast)
    _assert_same(span_contrast, back)
    assert back.output_tokens == ["t3+t4"] and back.contrast_tokens == ["t8"] * 3 and back.score_kind == "log_prob"


def test_float32_and_non_finite_values_round_trip(single):
    scores = torch.tensor([1.5, -math.inf, math.inf], dtype=torch.float32)
    result = GenerationResult(
        input_tokens=single.input_tokens, output_tokens=single.output_tokens, token_attr=single.token_attr.float(),
        target_attr=single.target_attr.float(), target_attr_tokens=single.target_attr_tokens,
        output_probs=single.output_probs.float(), scores=scores, score_kind="logit", method="X",
        first_token_share=torch.tensor([math.nan, 0.25, 1.0 / 3.0], dtype=torch.float32),
        input_ids=single.input_ids, output_ids=single.output_ids)
    text = json.dumps(result_to_dict(result), allow_nan=False)  # strictly valid JSON
    back = result_from_dict(json.loads(text))
    assert back.scores.dtype == torch.float32 and torch.equal(back.scores, scores)
    assert torch.allclose(back.first_token_share, result.first_token_share, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(back.token_attr, result.token_attr)


def test_wrong_schema_missing_field_and_bad_shape_are_refused(single):
    d = result_to_dict(single)
    with pytest.raises(InputError, match="schema"):
        result_from_dict({**d, "schema": "captum_transformers.explain.scores/1"})
    with pytest.raises(InputError, match="target_attr_tokens"):
        result_from_dict({k: v for k, v in d.items() if k != "target_attr_tokens"})
    short = {**d, "input_tokens": d["input_tokens"][:-1]}
    with pytest.raises(InputError, match="token_attr"):
        result_from_dict(short)
    with pytest.raises(InputError, match="'scores'"):
        result_from_dict({**d, "scores": {**d["scores"], "values": ["oops", 1.0, 2.0]}})


def test_scores_json_round_trip_with_meta(tmp_path, llama, single):
    raw = GenerationAttribution(RawAttention(llama), IdTokenizer()).attribute(PROMPT, target=TARGET)
    path = save_scores_json({"attn-lrp": single, "raw": raw}, tmp_path / "scores.json", prompt=PROMPT, model="llama")
    payload = json.loads(path.read_text())
    assert payload["schema"] == SCORES_SCHEMA and payload["prompt"] == PROMPT and payload["model"] == "llama"
    assert payload["score_kind"] == "logit" and payload["output_tokens"] == ["t3", "t4", "t6"]
    assert payload["output_probs"] == single.output_probs.tolist()
    loaded = load_scores_json(path)
    assert list(loaded) == ["attn-lrp", "raw"]
    _assert_same(single, loaded["attn-lrp"])
    _assert_same(raw, loaded["raw"])


def test_scores_json_refusals(tmp_path, llama, single):
    other = GenerationAttribution(AttnLRP(llama), IdTokenizer()).attribute(PROMPT, target="3 4")
    with pytest.raises(InputError, match="one prompt"):
        save_scores_json({"a": single, "b": other}, tmp_path / "s.json")
    with pytest.raises(InputError, match="methods"):
        save_scores_json({"a": single}, tmp_path / "s.json", methods="x")
    with pytest.raises(InputError, match="JSON-safe"):
        save_scores_json({"a": single}, tmp_path / "s.json", model=object())
    (tmp_path / "w.json").write_text(json.dumps({"schema": "captum_transformers.explain.scores/1"}))
    with pytest.raises(InputError, match="schema"):
        load_scores_json(tmp_path / "w.json")


def _sequence(d):
    assert d["__instance_type__"] == list(INSEQ_OUTPUT_TYPE)
    assert d["attributes"]["step_attributions"] is None
    sequences = d["attributes"]["sequence_attributions"]
    assert len(sequences) == 1 and sequences[0]["__instance_type__"] == list(INSEQ_SEQUENCE_TYPE)
    sequence = sequences[0]["attributes"]
    assert sorted(sequence) == sorted(SEQUENCE_FIELDS)
    for token in sequence["source"] + sequence["target"]:
        assert token["__instance_type__"] == list(INSEQ_TOKEN_TYPE) and set(token["attributes"]) == {"id", "token"}
    return sequence


def test_inseq_json_decoder_only_layout(tmp_path, single):
    path = save_inseq_json(single, tmp_path / "out.json", model_name="tiny-llama")
    d = json.loads(path.read_text())
    sequence = _sequence(d)
    prompt_length, steps = len(single.input_tokens), len(single.output_tokens)
    assert sequence["source_attributions"] is None and sequence["attr_pos_start"] == prompt_length
    assert sequence["attr_pos_end"] == prompt_length + steps
    assert [t["attributes"]["token"] for t in sequence["target"]] == single.input_tokens + single.output_tokens
    assert [t["attributes"]["id"] for t in sequence["target"]] == single.input_ids + single.output_ids
    rows = tensor_from_safetensor_b64(sequence["target_attributions"])
    assert rows.shape == (prompt_length + steps, steps) and rows.dtype == torch.float64
    assert torch.equal(rows[:prompt_length], single.token_attr.t())
    output_rows = rows[prompt_length:]
    unread = torch.ones(steps, steps, dtype=torch.bool).triu()  # step t has read outputs j < t
    assert output_rows.t()[unread].isnan().all() and torch.equal(output_rows.t()[~unread], single.target_attr[~unread])
    assert torch.equal(tensor_from_safetensor_b64(sequence["step_scores"]["probability"]), single.output_probs)
    assert torch.equal(tensor_from_safetensor_b64(sequence["step_scores"]["logit"]), single.scores)
    info = d["attributes"]["info"]
    assert info["attribution_method"] == "AttnLRP" and info["model_name"] == "tiny-llama"


def test_inseq_json_encoder_decoder_layout():
    result = GenerationAttribution(AttnLRP(build("bart")), IdTokenizer()).attribute(PROMPT, target=TARGET)
    sequence = _sequence(to_inseq_dict(result))
    steps, source_length = len(result.output_tokens), len(result.input_tokens)
    source = tensor_from_safetensor_b64(sequence["source_attributions"])
    assert source.shape == (source_length, steps) and torch.equal(source, result.token_attr.t())
    rows = tensor_from_safetensor_b64(sequence["target_attributions"])
    assert rows.shape == (steps + 1, steps) and sequence["attr_pos_start"] == 1
    target_tokens = [t["attributes"]["token"] for t in sequence["target"]]
    assert target_tokens == result.target_attr_tokens[:1] + result.output_tokens
    read = torch.ones(steps, steps, dtype=torch.bool).tril()  # step t has read decoder inputs j <= t
    assert torch.equal(rows[:steps].t()[read], result.target_attr[read])
    assert rows[:steps].t()[~read].isnan().all() and rows[steps].isnan().all()


def test_inseq_export_refuses_spans_and_lost_scores(single, span_contrast):
    with pytest.raises(InputError, match="span"):
        to_inseq_dict(span_contrast)
    d = result_to_dict(single)
    d["target_attr"]["values"][0][2] = 0.5  # a score on a token step 0 never read
    with pytest.raises(InputError, match="not read"):
        to_inseq_dict(result_from_dict(d))


@pytest.mark.skipif(importlib.util.find_spec("inseq") is not None, reason="inseq is installed here")
def test_inseq_method_module_needs_inseq():
    with pytest.raises(ImportError, match="needs inseq"):
        import captum_transformers.integrations.inseq.method  # noqa: F401
