"""``GenerationResult.sink_share``: per explained row, the probability the step's query put on a
learned attention-sink slot (GPT-OSS's ``sinks`` / ``s_aux``), averaged over heads and layers.

It is read from the explanation's own forward pass (the recorder keeps each map's sum over keys at
the explained positions, or takes it from the map a streamed kernel recomputes in the backward pass),
so on a tiny float64 GPT-OSS it equals ``1 - row sum`` of the model's eager ``output_attentions`` to
1e-10 for every method whose maps are made at those rows, whatever the method; it is None on a model
without a sink slot (Llama) and for the methods that make no such map (Captum's IG / Saliency
prefix calls, AttentionGradCAM's streamed last-layer-only backward). Generation rows equal calls on
each prefix and a padded batch equals single prompts; the field survives JSON (null stays None, an
older file without it reads as None) and is drawn beside the first-token share.
"""
from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from generation_models import IdTokenizer, build
from test_attention_sinks import gpt_oss as sinks_model

import captum_transformers.capture.row_chunks as row_chunks
from captum_transformers.errors import InputError
from captum_transformers.generation import GenerationAttribution
from captum_transformers.generation.serialization import (load_scores_json, result_from_dict, result_to_dict,
                                                          save_scores_json)
from captum_transformers.methods.catalog import build_method
from captum_transformers.visualization import GenerationMatrix

transformers = pytest.importorskip("transformers")

PROMPT, TARGET = [1, 5, 7, 9, 11], [20, 21, 22]
HEADS = 4
_MODELS: dict = {}

# Every method whose maps are made at the explained rows: read in the forward pass (maps, relevance
# through the kernel's operands) or from the backward pass of a streamed map (generic-attention,
# transformer-relevance).
WITH_SHARE = ["attn-lrp", "gradient-x-input", "lrp", "conservative-lrp", "conservative-lrp-ah", "partial-lrp",
              "raw-attention", "rollout", "attention-flow", "generic-attention", "transformer-relevance"]
WITHOUT_SHARE = ["grad-cam", "saliency"]


def gpt_oss() -> torch.nn.Module:
    """test_attention_sinks' tiny GPT-OSS (two layers: a 4-token sliding window, then full; 4 query
    heads over 2 key-value heads, two experts, float64, eager attention), copied, with sinks that
    differ per head and per layer, large enough to matter."""
    if "gpt_oss" not in _MODELS:
        model = copy.deepcopy(sinks_model())
        with torch.no_grad():
            for index, layer in enumerate(model.model.layers):
                layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, HEADS, dtype=torch.float64) + 0.5 * index)
        _MODELS["gpt_oss"] = model
    return _MODELS["gpt_oss"]


def llama() -> torch.nn.Module:
    if "llama" not in _MODELS:
        _MODELS["llama"] = build("llama")
    return _MODELS["llama"]


def reference(model: torch.nn.Module, prompt, target) -> torch.Tensor:
    """(T,) from the model's own eager maps on prompt + target: ``1 - sum_k A_qk`` at each step's query
    position (the one whose logits predict the step's token), the mean over heads and layers."""
    ids = torch.tensor([list(prompt) + list(target)])
    with torch.no_grad():
        maps = model(ids, output_attentions=True).attentions
    assert len(maps) == 2 and maps[0].shape[1] == HEADS
    per_position = torch.stack([1 - a[0].sum(-1) for a in maps]).mean(dim=(0, 1))  # (N,)
    return per_position[[len(prompt) - 1 + t for t in range(len(target))]]


def explain(name: str, model: torch.nn.Module, prompt, target, **kwargs):
    return GenerationAttribution(build_method(name, model), IdTokenizer()).attribute(prompt, target=target, **kwargs)


@pytest.mark.parametrize("name", WITH_SHARE)
def test_sink_share_equals_the_eager_maps_for_every_method(name):
    model = gpt_oss()
    result = explain(name, model, PROMPT, TARGET)
    expected = reference(model, PROMPT, TARGET)
    assert result.sink_share is not None and result.sink_share.shape == (len(TARGET),)
    assert result.sink_share.dtype == torch.float64
    torch.testing.assert_close(result.sink_share, expected, rtol=0, atol=1e-10)
    assert bool((expected > 0.05).all()) and bool((expected < 0.95).all())  # the sink takes a real share
    assert not torch.allclose(result.sink_share, result.first_token_share)  # another quantity


def test_sink_share_is_the_same_for_every_method():
    model = gpt_oss()
    shares = [explain(name, model, PROMPT, TARGET).sink_share for name in ("attn-lrp", "raw-attention",
                                                                        "generic-attention")]
    for share in shares[1:]:
        torch.testing.assert_close(share, shares[0], rtol=0, atol=1e-12)


def test_streamed_maps_give_it_from_their_row_chunks(monkeypatch):
    """A streamed map is never made whole: with one query row per chunk, the sums come from the rows
    the backward pass recomputes (keys cut at the causal boundary)."""
    monkeypatch.setattr(row_chunks, "ROW_CHUNK_BYTES", 1)
    model = gpt_oss()
    prompt = PROMPT + [3, 4]
    for name in ("generic-attention", "transformer-relevance"):
        torch.testing.assert_close(explain(name, model, prompt, TARGET).sink_share, reference(model, prompt, TARGET),
                                   rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", WITHOUT_SHARE)
def test_methods_that_make_no_map_at_the_rows_give_none(name):
    result = explain(name, gpt_oss(), PROMPT, TARGET)
    assert result.sink_share is None
    assert result.token_attr.abs().sum() > 0 or name == "grad-cam"


@pytest.mark.parametrize("name", ["attn-lrp", "raw-attention", "generic-attention"])
def test_a_model_without_a_sink_slot_gives_none(name):
    result = explain(name, llama(), [1, 5, 7, 9], [3, 4, 6])
    assert result.sink_share is None and result.first_token_share.shape == (3,)


@pytest.mark.parametrize("name", ["attn-lrp", "generic-attention"])
def test_generation_rows_equal_calls_on_each_prefix(name):
    model = gpt_oss()
    whole = explain(name, model, PROMPT, TARGET).sink_share
    for t, token in enumerate(TARGET):
        alone = explain(name, model, PROMPT + TARGET[:t], [token]).sink_share
        assert alone.shape == (1,)
        torch.testing.assert_close(whole[t], alone[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["attn-lrp", "generic-attention"])
def test_a_padded_batch_equals_single_prompts(name):
    model = gpt_oss()
    prompts, targets = [PROMPT, [6, 8, 10]], [TARGET, [12, 14]]
    batch = GenerationAttribution(build_method(name, model), IdTokenizer()).attribute(prompts, target=targets)
    for result, prompt, target in zip(batch, prompts, targets):
        assert result.sink_share.shape == (len(target),)
        torch.testing.assert_close(result.sink_share, reference(model, prompt, target), rtol=0, atol=1e-10)


def test_a_span_reads_its_latest_step():
    model = gpt_oss()
    result = explain("attn-lrp", model, PROMPT, TARGET, span=[0, 1])
    torch.testing.assert_close(result.sink_share, reference(model, PROMPT, TARGET)[1:2], rtol=0, atol=1e-10)


def _through_json(result):
    return result_from_dict(json.loads(json.dumps(result_to_dict(result), allow_nan=False)))


def test_serialization_round_trip_keeps_it_bit_for_bit():
    result = explain("attn-lrp", gpt_oss(), PROMPT, TARGET)
    written = result_to_dict(result)
    assert written["sink_share"]["shape"] == [len(TARGET)]
    back = _through_json(result)
    assert back.sink_share.dtype == result.sink_share.dtype and torch.equal(back.sink_share, result.sink_share)
    torch.testing.assert_close(back.first_token_share, result.first_token_share, rtol=0, atol=0)


def test_none_stays_none_and_older_files_still_load():
    result = explain("attn-lrp", llama(), [1, 5, 7, 9], [3, 4, 6])
    written = result_to_dict(result)
    assert written["sink_share"] is None
    assert _through_json(result).sink_share is None
    older = {key: value for key, value in written.items() if key != "sink_share"}
    assert result_from_dict(older).sink_share is None


def test_a_wrong_shape_is_refused(tmp_path):
    result = explain("attn-lrp", gpt_oss(), PROMPT, TARGET)
    written = result_to_dict(result)
    short = {**written, "sink_share": {**written["sink_share"], "shape": [2], "values": [0.1, 0.2]}}
    with pytest.raises(InputError, match="sink_share"):
        result_from_dict(short)
    path = save_scores_json({"attn-lrp": result}, tmp_path / "scores.json", prompt="p")
    assert torch.equal(load_scores_json(path)["attn-lrp"].sink_share, result.sink_share)


def test_the_matrix_shows_it_beside_the_first_token_share(tmp_path):
    result = explain("attn-lrp", gpt_oss(), PROMPT, TARGET)
    assert GenerationMatrix(result).save(tmp_path / "matrix.png").stat().st_size > 0  # the drawing's column too
    page = GenerationMatrix(result)._body_html()
    shown = [int(cell) for cell in re.findall(r"<td class='sink'>(\d+)%</td>", page)]
    assert shown == [round(100 * float(s)) for s in result.sink_share]
    assert "sink slot %" in page and "Sink slot" in page
    plain = GenerationMatrix(explain("attn-lrp", llama(), [1, 5, 7, 9], [3, 4, 6]))._body_html()
    assert "class='sink'" not in plain and "sink slot" not in plain


def test_a_layer_without_a_sink_slot_counts_zero():
    """MiMo-V2-Flash keeps sinks on its sliding layers only (``sinks = None`` elsewhere): such a layer
    puts nothing on a slot, and counts 0 in the mean, as a sink logit of -inf does in the eager maps."""
    model = gpt_oss()
    partial, closed = copy.deepcopy(model), copy.deepcopy(model)
    partial.model.layers[1].self_attn.sinks = None
    with torch.no_grad():
        closed.model.layers[1].self_attn.sinks.fill_(-float("inf"))
    result = explain("attn-lrp", partial, PROMPT, TARGET)
    expected = reference(closed, PROMPT, TARGET)
    torch.testing.assert_close(result.sink_share, expected, rtol=0, atol=1e-10)
    assert not torch.allclose(expected, reference(model, PROMPT, TARGET))
