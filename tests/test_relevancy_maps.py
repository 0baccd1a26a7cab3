"""The ICCV'21 update rules between token streams, against a slow reference written from the
paper (per example, explicit loops), and the multi-stream reductions of every attention method
on hand-built traces."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from captum_transformers import AttentionGradCAM, AttentionRollout, GenericAttention, RawAttention
from captum_transformers import InputError
from captum_transformers.methods.math import relevancy_maps
from captum_transformers.functional import add_identity_and_normalize, self_attention_relevance_rows
from captum_transformers.methods.transformer_relevance import PartialLRP, TransformerRelevance
from captum_transformers.capture.trace import AttentionRecord, AttentionTrace, Block, InputSpan, StreamLayouts, TokenLayout

# Call sequences of the three architecture types of the paper's Fig. 2.
LXMERT_LIKE = [("text", "text"), ("image", "image"), ("text", "image"), ("image", "text"),
               ("text", "text"), ("image", "image"), ("text", "image"), ("image", "text"), ("text", "text")]
DETR_LIKE = [("encoder", "encoder"), ("encoder", "encoder"), ("decoder", "decoder"), ("decoder", "encoder"),
             ("decoder", "decoder"), ("decoder", "encoder")]
SIZES = {"text": 5, "image": 4, "encoder": 6, "decoder": 3}


def _random_steps(pairs, batch=2, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    steps = []
    for query, key in pairs:
        abar = torch.rand(batch, SIZES[query], SIZES[key], generator=generator, dtype=dtype) * 0.3
        steps.append(((query, key), abar))
    return steps


# -- the slow reference, one example at a time, written from Eq. 1-11 --------------------------
def _reference_normalized(self_map):
    """Eq. 8-9 with explicit loops over rows and columns."""
    size = self_map.shape[0]
    out = torch.zeros_like(self_map)
    for m in range(size):
        row_sum = sum(float(self_map[m, l]) - (1.0 if l == m else 0.0) for l in range(size))
        for n in range(size):
            hat = float(self_map[m, n]) - (1.0 if m == n else 0.0)
            out[m, n] = (hat / row_sum if row_sum != 0 else 0.0) + (1.0 if m == n else 0.0)
    return out


def _reference(steps, sizes, example, layers=None):
    """``layers``: the steps grouped into layers whose calls read the same inputs (default:
    one call per layer); every addition of a layer is computed from the maps before it."""
    streams = list(dict.fromkeys(name for pair, _ in steps for name in pair))
    maps = {}
    for s in streams:  # Eq. 1-2
        for t in streams:
            maps[(s, t)] = torch.eye(sizes[s], dtype=torch.float64) if s == t else torch.zeros(
                sizes[s], sizes[t], dtype=torch.float64)
    for layer in layers or [[step] for step in steps]:
        additions = []
        for (q, k), abar in layer:
            a = abar[example]
            if q == k:  # Eq. 6 and Eq. 7
                additions += [((q, t), a @ maps[(q, t)]) for t in streams]
            else:  # Eq. 10 and Eq. 11
                additions.append(((q, k), _reference_normalized(maps[(q, q)]).T @ a @ _reference_normalized(maps[(k, k)])))
                additions.append(((q, q), a @ maps[(k, q)]))
        for pair, addition in additions:
            maps[pair] = maps[pair] + addition
    return maps


@pytest.mark.parametrize("pairs", [LXMERT_LIKE, DETR_LIKE], ids=["co-attention", "encoder-decoder"])
def test_accumulate_matches_the_per_example_reference(pairs):
    steps = _random_steps(pairs)
    sizes = {name: SIZES[name] for pair in pairs for name in pair}
    maps = relevancy_maps.accumulate(steps, sizes)
    for example in range(2):
        expected = _reference(steps, sizes, example)
        for pair, value in expected.items():
            torch.testing.assert_close(maps[pair][example], value, rtol=1e-10, atol=1e-12)


def test_co_attention_directions_of_one_layer_are_applied_together():
    """LXMERT computes text-over-image and image-over-text from the same layer inputs."""
    steps = _random_steps(LXMERT_LIKE)
    groups = [None, None, "x0", "x0", None, None, "x1", "x1", None]
    layers = [[steps[0]], [steps[1]], steps[2:4], [steps[4]], [steps[5]], steps[6:8], [steps[8]]]
    sizes = {"text": 5, "image": 4}
    together = relevancy_maps.accumulate(steps, sizes, groups=groups)
    one_by_one = relevancy_maps.accumulate(steps, sizes)
    for example in range(2):
        expected = _reference(steps, sizes, example, layers)
        for pair, value in expected.items():
            torch.testing.assert_close(together[pair][example], value, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(together[("text", "image")], one_by_one[("text", "image")])


def test_encoder_decoder_keeps_no_encoder_to_decoder_map():
    maps = relevancy_maps.accumulate(_random_steps(DETR_LIKE), {"encoder": 6, "decoder": 3})
    assert torch.count_nonzero(maps[("encoder", "decoder")]) == 0
    assert torch.count_nonzero(maps[("decoder", "encoder")]) > 0


def test_normalized_rows_sum_to_one_after_removing_the_identity():
    """Eq. 9: each row of Rbar - I sums to 1; an untouched row stays the identity."""
    steps = _random_steps([("text", "text"), ("text", "text")])
    self_map = relevancy_maps.accumulate(steps, {"text": 5})[("text", "text")]
    normalized = relevancy_maps.normalized_self_relevance(self_map) - torch.eye(5, dtype=torch.float64)
    torch.testing.assert_close(normalized.sum(-1), torch.ones(2, 5, dtype=torch.float64))
    untouched = relevancy_maps.normalized_self_relevance(torch.eye(3, dtype=torch.float64).expand(2, 3, 3))
    torch.testing.assert_close(untouched, torch.eye(3, dtype=torch.float64).expand(2, 3, 3))


def test_without_cross_attention_the_rules_reduce_to_the_self_attention_rule():
    steps = _random_steps([("text", "text")] * 4)
    maps = relevancy_maps.accumulate(steps, {"text": 5})
    start = torch.zeros(2, 5, dtype=torch.float64)
    start[:, 0] = 1
    rows = self_attention_relevance_rows([abar for _, abar in steps], start)
    torch.testing.assert_close(relevancy_maps.explained_rows(maps, {"text": start})["text"], rows)


def test_explained_rows_sum_over_explained_streams():
    maps = relevancy_maps.accumulate(_random_steps(LXMERT_LIKE), {"text": 5, "image": 4})
    text_row = torch.zeros(2, 5, dtype=torch.float64)
    text_row[:, 0] = 1
    image_row = torch.zeros(2, 4, dtype=torch.float64)
    image_row[:, 0] = 1
    only_text = relevancy_maps.explained_rows(maps, {"text": text_row})
    both = relevancy_maps.explained_rows(maps, {"text": text_row, "image": image_row})
    torch.testing.assert_close(only_text["image"], maps[("text", "image")][:, 0])
    torch.testing.assert_close(both["image"], maps[("text", "image")][:, 0] + maps[("image", "image")][:, 0])


# -- the methods on hand-built multi-stream traces ----------------------------------------------
def _layout(stream, row=0, mask=None):
    return TokenLayout(SIZES[stream], torch.full((2, 1), row), mask)


def _trace(pairs, explained, forward=False, masks=None, seed=0, groups=None, steps=None):
    steps = steps or _random_steps(pairs, seed=seed)
    groups = groups or [None] * len(steps)
    block = Block("attention", nn.Identity())
    records = tuple(
        AttentionRecord(block, index, value if forward else None, None if forward else value, pair, group)
        for index, ((pair, value), group) in enumerate(zip(steps, groups))
    )
    names = list(dict.fromkeys(name for pair in pairs for name in pair))
    masks = masks or {}
    layouts = {name: _layout(name, row=1 if name == "decoder" else 0, mask=masks.get(name)) for name in names}
    streams = StreamLayouts(layouts, explained, tuple(InputSpan(name) for name in names))
    return AttentionTrace(records, layouts[explained[0]], torch.zeros(2, 3), None, streams), steps


def _method(cls):
    return cls(nn.MultiheadAttention(4, 1))  # any supported model: reduce() reads only the trace


def _one_hot(stream, row):
    vector = torch.zeros(2, SIZES[stream], dtype=torch.float64)
    vector[:, row] = 1
    return vector


@pytest.mark.parametrize("pairs,explained,row", [(LXMERT_LIKE, ("text",), 0), (DETR_LIKE, ("decoder",), 1)])
def test_generic_attention_reads_the_explained_rows_of_the_reference_maps(pairs, explained, row):
    trace, steps = _trace(pairs, explained)
    scores = _method(GenericAttention).reduce(trace)
    sizes = {name: SIZES[name] for pair in pairs for name in pair}
    for example in range(2):
        expected = _reference(steps, sizes, example)
        for stream in sizes:
            torch.testing.assert_close(scores[stream][example], expected[(explained[0], stream)][row])


def test_generic_attention_applies_the_groups_of_the_trace():
    groups = [None, None, "x0", "x0", None, None, "x1", "x1", None]
    trace, steps = _trace(LXMERT_LIKE, ("text",), groups=groups)
    scores = _method(GenericAttention).reduce(trace)
    layers = [[steps[0]], [steps[1]], steps[2:4], [steps[4]], [steps[5]], steps[6:8], [steps[8]]]
    expected = _reference(steps, {"text": 5, "image": 4}, 1, layers)
    torch.testing.assert_close(scores["image"][1], expected[("text", "image")][0])


def test_generic_attention_start_layer_counts_calls_per_query_stream():
    trace, steps = _trace(DETR_LIKE, ("decoder",))
    scores = GenericAttention(nn.MultiheadAttention(4, 1), start_layer=1).reduce(trace)
    kept = [steps[1], steps[3], steps[4], steps[5]]  # encoder call 1; decoder calls 1, 2, 3
    expected = _reference(kept, {"encoder": 6, "decoder": 3}, 0)
    torch.testing.assert_close(scores["encoder"][0], expected[("decoder", "encoder")][1])
    per_stream = GenericAttention(nn.MultiheadAttention(4, 1), start_layer={"encoder": 1}).reduce(trace)
    expected = _reference(steps[1:], {"encoder": 6, "decoder": 3}, 0)
    torch.testing.assert_close(per_stream["encoder"][0], expected[("decoder", "encoder")][1])


@pytest.mark.parametrize("cls", [GenericAttention, AttentionRollout, TransformerRelevance])
@pytest.mark.parametrize("start_layer", [2, {"encoder": 2}, {"image": 0}, -1], ids=["int", "dict", "unknown", "negative"])
def test_a_start_layer_that_empties_a_stream_is_an_error(cls, start_layer):
    trace, _ = _trace(DETR_LIKE, ("decoder",), forward=cls is AttentionRollout)
    with pytest.raises(InputError, match="start_layer"):
        cls(nn.MultiheadAttention(4, 1), start_layer=start_layer).reduce(trace)


def _with_padding(steps, padded, fill_query, fill_key):
    """Copies of the text-stream maps with the padded query rows and key columns filled."""
    filled = []
    for (query, key), value in steps:
        value = value.clone()
        if query == "text":
            value[padded] = fill_query
        if key == "text":
            value.transpose(1, 2)[padded] = fill_key
        filled.append(((query, key), value))
    return filled


@pytest.mark.parametrize("cls", [GenericAttention, TransformerRelevance, RawAttention, AttentionRollout])
def test_padded_rows_and_columns_never_change_the_result(cls):
    """Garbage in the padded rows and columns of every map gives the scores of zeros there."""
    mask = torch.ones(2, SIZES["text"], dtype=torch.bool)
    mask[1, 3:] = False
    steps = _random_steps(LXMERT_LIKE)
    noisy_steps, clean_steps = _with_padding(steps, ~mask, 5.0, 7.0), _with_padding(steps, ~mask, 0.0, 0.0)
    forward = cls in (RawAttention, AttentionRollout)
    noisy, _ = _trace(LXMERT_LIKE, ("text",), forward=forward, masks={"text": mask}, steps=noisy_steps)
    clean, _ = _trace(LXMERT_LIKE, ("text",), forward=forward, masks={"text": mask}, steps=clean_steps)
    noisy_scores, clean_scores = _method(cls).reduce(noisy), _method(cls).reduce(clean)
    for stream in ("text", "image"):
        torch.testing.assert_close(noisy_scores[stream], clean_scores[stream])
    unmasked, _ = _trace(LXMERT_LIKE, ("text",), forward=forward, steps=noisy_steps)
    unmasked_scores = _method(cls).reduce(unmasked)
    assert any(not torch.allclose(unmasked_scores[s], clean_scores[s]) for s in ("text", "image"))  # it would matter


def test_rollout_uses_eq_12_between_streams():
    trace, steps = _trace(DETR_LIKE, ("decoder",), forward=True)
    scores = _method(AttentionRollout).reduce(trace)
    encoder = torch.eye(6, dtype=torch.float64).expand(2, 6, 6)
    decoder = torch.eye(3, dtype=torch.float64).expand(2, 3, 3)
    for (query, _), value in steps:
        if query == "encoder" and _ == "encoder":
            encoder = add_identity_and_normalize(value) @ encoder
        elif query == "decoder" and _ == "decoder":
            decoder = add_identity_and_normalize(value) @ decoder
    last_cross = steps[-1][1]
    expected_cross = decoder.transpose(1, 2) @ last_cross @ encoder
    torch.testing.assert_close(scores["encoder"], expected_cross[:, 1])
    torch.testing.assert_close(scores["decoder"], decoder[:, 1])


@pytest.mark.parametrize("cls,forward", [(RawAttention, True), (AttentionGradCAM, False), (PartialLRP, False)])
def test_last_map_baselines_read_the_last_map_of_each_stream_pair(cls, forward):
    # The trace holds fused (B, Q, K) maps: what Grad-CAM's head_weights="all" records.
    trace, steps = _trace(LXMERT_LIKE, ("text",), forward=forward)
    method = AttentionGradCAM(nn.MultiheadAttention(4, 1), head_weights="all") if cls is AttentionGradCAM \
        else _method(cls)
    scores = method.reduce(trace)
    last = {pair: value for pair, value in steps}
    torch.testing.assert_close(scores["text"], last[("text", "text")][:, 0])
    torch.testing.assert_close(scores["image"], last[("text", "image")][:, 0])


def test_transformer_relevance_chains_self_maps_and_takes_the_last_cross_map():
    trace, steps = _trace(LXMERT_LIKE, ("text",))
    scores = _method(TransformerRelevance).reduce(trace)
    text_maps = [value for pair, value in steps if pair == ("text", "text")]
    torch.testing.assert_close(scores["text"], self_attention_relevance_rows(text_maps, _one_hot("text", 0)))
    last_cross = [value for pair, value in steps if pair == ("text", "image")][-1]
    torch.testing.assert_close(scores["image"], last_cross[:, 0])


def test_a_stream_without_a_layout_is_a_clear_error():
    trace, _ = _trace(DETR_LIKE, ("decoder",))
    broken = AttentionTrace(trace.records, trace.layout, trace.logits, None,
                            StreamLayouts({"decoder": trace.streams.layouts["decoder"]}, ("decoder",), ()))
    with pytest.raises(Exception, match="layouts only describe"):
        _method(GenericAttention).reduce(broken)


def test_row_normalized_transformer_relevance_refuses_several_streams():
    trace, _ = _trace(LXMERT_LIKE, ("text",))
    with pytest.raises(InputError, match="row_normalize=True follows the authors' BERT generator"):
        TransformerRelevance(nn.MultiheadAttention(4, 1), row_normalize=True).reduce(trace)
    with pytest.raises(InputError, match="row_normalize must be True or False"):
        TransformerRelevance(nn.MultiheadAttention(4, 1), row_normalize="yes")


def test_attention_flow_refuses_several_streams():
    from captum_transformers import AttentionFlow

    trace, _ = _trace(LXMERT_LIKE, ("text",), forward=True)
    with pytest.raises(InputError, match="AttentionFlow is defined for one token sequence"):
        AttentionFlow(nn.MultiheadAttention(4, 1)).reduce(trace)
