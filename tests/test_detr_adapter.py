"""The DETR adapter: streams, layouts, (query, class) targets, restore, rules, detections."""
from __future__ import annotations

import pytest
import torch

from detr_models import NUM_LABELS, NUM_QUERIES, STRIDE, detr, images, padded_mask
from restore import assert_same, raising_after, snapshot

from captum_transformers import CaptureError, InputError, RuleSet, explain_detections, get_adapter
from captum_transformers.adapters.huggingface.detr import DetrAdapter, feature_grid
from captum_transformers.capture.trace import CaptureSpec, InputSpan
from captum_transformers.engine.runner import run_trace

ENC, DEC = "encoder", "decoder"
CALL_STREAMS = [(ENC, ENC)] * 2 + [(DEC, DEC), (DEC, ENC)] * 2
PRESETS = ["GRADIENT", "AH", "AH_LN", "CHEFER", "LRP", "ATTN_LRP"]

# Keep the per-head maps (forward) and the per-head gradients (backward).
KEEP = CaptureSpec(forward_reduce=lambda probs: probs, backward_reduce=lambda probs, grad, valid: grad)


@pytest.fixture(scope="module")
def model():
    return detr()


def trace(model, inputs, target=None, spec=KEEP, **forward_kwargs):
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    return run_trace(get_adapter(model), model, inputs, (), target, spec, forward_kwargs)


def test_registry_picks_the_detr_adapter_before_the_generic_entry(model):
    from transformers import BertConfig, BertModel

    assert isinstance(get_adapter(model), DetrAdapter)
    assert get_adapter(model.model).name == "detr"  # DetrModel is a DetrPreTrainedModel too
    bert = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64))
    assert get_adapter(bert).name == "huggingface"


def test_blocks_carry_their_streams(model):
    blocks = get_adapter(model).blocks(model)
    assert [b.name for b in blocks] == [
        "model.encoder.layers.0.self_attn", "model.encoder.layers.1.self_attn",
        "model.decoder.layers.0.self_attn", "model.decoder.layers.0.encoder_attn",
        "model.decoder.layers.1.self_attn", "model.decoder.layers.1.encoder_attn",
    ]
    assert [b.streams for b in blocks] == CALL_STREAMS
    assert [b.kind for b in blocks] == ["self"] * 3 + ["cross", "self", "cross"]


def test_capture_records_every_call_with_its_stream_pair(model):
    pixels = images()
    recorded = trace(model, pixels, (0, 0))
    config = model.config
    assert len(recorded) == config.encoder_layers + 2 * config.decoder_layers
    assert [r.streams for r in recorded.records] == CALL_STREAMS
    assert [r.call_index for r in recorded.records] == list(range(len(recorded)))
    tokens = (64 // STRIDE) * (48 // STRIDE)
    shapes = {(ENC, ENC): (tokens, tokens), (DEC, DEC): (NUM_QUERIES, NUM_QUERIES), (DEC, ENC): (NUM_QUERIES, tokens)}
    for record in recorded.records:
        assert tuple(record.forward_value.shape) == (2, 4, *shapes[record.streams])
        assert record.backward_value.shape == record.forward_value.shape


def test_recorded_probabilities_are_the_models_attentions(model):
    pixels, mask = images(), padded_mask()
    with torch.no_grad():
        reference = model(pixels, pixel_mask=mask, output_attentions=True)
    expected = [*reference.encoder_attentions]
    for own, cross in zip(reference.decoder_attentions, reference.cross_attentions):
        expected += [own, cross]
    recorded = trace(model, (pixels, mask), (1, 2))
    assert len(expected) == len(recorded)
    for record, attention in zip(recorded.records, expected):
        torch.testing.assert_close(record.forward_value, attention, rtol=0, atol=1e-6)


@pytest.mark.parametrize("size", [(64, 48), (65, 50), (40, 72)])
def test_encoder_grid_is_the_backbone_feature_map(model, size):
    pixels = images(2, *size)
    with torch.no_grad():
        feature_map, _ = model.model.backbone(pixels, torch.ones(2, *size))[-1]
    streams = trace(model, pixels, (0, 0), CaptureSpec()).streams
    encoder = streams.layouts[ENC]
    assert encoder.grid == tuple(feature_map.shape[-2:])
    assert encoder.num_tokens == feature_map.shape[-2] * feature_map.shape[-1]
    assert encoder.token_mask is None and encoder.num_prefix_tokens == 0
    assert streams.layouts[DEC].num_tokens == NUM_QUERIES and streams.layouts[DEC].grid is None
    assert streams.explained == (DEC,)
    assert streams.inputs == (InputSpan(ENC, 0, None, encoder.grid),)


def test_pixel_mask_gives_the_encoder_padding_and_no_input_span(model):
    pixels, mask = images(), padded_mask()
    streams = trace(model, (pixels, mask), (0, 0), CaptureSpec()).streams
    encoder = streams.layouts[ENC]
    # The model's own downsampled mask: example 1 keeps a 5x4 corner of the 8x6 grid.
    expected = torch.zeros(2, 8, 6, dtype=torch.bool)
    expected[0] = True
    expected[1, :5, :4] = True
    assert torch.equal(encoder.token_mask, expected.flatten(1))
    assert streams.inputs == (InputSpan(ENC, 0, None, (8, 6)), None)


def test_detr_query_selection_returns_the_right_rows(model):
    pixels = images()
    adapter = get_adapter(model)
    with torch.no_grad():
        logits = model(pixels).logits
    for target, pairs in [((3, 1), [(3, 1), (3, 1)]), ([(4, 0), (1, 2)], [(4, 0), (1, 2)]),
                          (torch.tensor([[2, 3], [0, 1]]), [(2, 3), (0, 1)])]:
        scores, _ = adapter.resolve_target(model, logits, target)
        torch.testing.assert_close(scores, torch.stack([logits[b, q, c] for b, (q, c) in enumerate(pairs)]))
        recorded = trace(model, pixels, target)
        assert recorded.target.tolist() == [list(p) for p in pairs]
        rows = recorded.streams.layouts[DEC].query_rows
        assert rows.tolist() == [[q] for q, _ in pairs]
        assert recorded.layout is recorded.streams.layouts[DEC]
        # The score reads one query: after the last cross-attention only that query's row
        # (a per-token MLP and norm follow) receives gradient.
        last = recorded.records[-1].backward_value
        for b, (q, _) in enumerate(pairs):
            others = torch.ones(NUM_QUERIES, dtype=torch.bool)
            others[q] = False
            assert last[b, :, q].abs().sum() > 0
            assert torch.equal(last[b][:, others], torch.zeros_like(last[b][:, others]))


def test_no_target_explains_the_most_confident_real_detection(model):
    pixels = images(3)
    with torch.no_grad():
        probs = model(pixels).logits.softmax(-1)
    recorded = trace(model, pixels, None, CaptureSpec())
    for b in range(3):
        q, c = recorded.target[b].tolist()
        assert c < NUM_LABELS  # never "no object"
        assert probs[b, q, c] == probs[b, :, :NUM_LABELS].max()
        assert recorded.streams.layouts[DEC].query_rows[b].tolist() == [q]
    # On this random model "no object" wins the plain arg-max, so the rule matters.
    assert (probs.flatten(1).argmax(1) % (NUM_LABELS + 1) == NUM_LABELS).any()


def test_a_class_only_target_is_refused_with_the_detr_form(model):
    with pytest.raises(InputError, match=r"\(query_index, class_index\)"):
        trace(model, images(), 1, CaptureSpec())


def test_non_image_input_and_impossible_grid_are_refused(model):
    with pytest.raises(CaptureError, match="no backbone stride"):
        feature_grid(64, 48, 47)
    assert feature_grid(64, 48, 48) == (8, 6) and feature_grid(65, 50, 63) == (9, 7)
    adapter = get_adapter(model)
    with pytest.raises(InputError, match="pixel_values"):
        adapter.stream_layouts(model, (torch.zeros(2, 48, 32),), None)


def test_batch_equals_single():
    model = detr(dtype=torch.float64)  # float64: batching changes float32 sums in the last bits
    pixels, mask = images(3, dtype=torch.float64), padded_mask(3)
    targets = [(0, 1), (4, 2), (2, 0)]
    batch = trace(model, (pixels, mask), targets)
    for i in range(3):
        single = trace(model, (pixels[i:i + 1], mask[i:i + 1]), targets[i])
        assert batch.target[i].tolist() == list(targets[i])
        torch.testing.assert_close(batch.logits[i:i + 1], single.logits, rtol=1e-10, atol=1e-12)
        for together, alone in zip(batch.records, single.records):
            torch.testing.assert_close(together.forward_value[i:i + 1], alone.forward_value, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(together.backward_value[i:i + 1], alone.backward_value, rtol=1e-8, atol=1e-12)


def test_exact_restore_and_unchanged_outputs(model):
    pixels = images()
    with torch.no_grad():
        before_output = model(pixels)
    before = snapshot(model)
    recorded = trace(model, pixels, (1, 1))
    # The capture's explicit kernel computes exactly what the eager one does.
    assert torch.equal(recorded.logits, before_output.logits)
    assert_same(before, snapshot(model))

    # KeyboardInterrupt is not an Exception: restore must not depend on `except Exception`.
    with raising_after(get_adapter(model).blocks(model)[3].module, KeyboardInterrupt()):
        with pytest.raises(KeyboardInterrupt):
            trace(model, pixels, (1, 1))
    assert_same(before, snapshot(model))
    with torch.no_grad():
        after_output = model(pixels)
    assert torch.equal(before_output.logits, after_output.logits)
    assert torch.equal(before_output.pred_boxes, after_output.pred_boxes)


@pytest.mark.parametrize("preset", PRESETS)
def test_propagation_rules_keep_the_forward_bit_identical(model, preset):
    pixels, mask = images(), padded_mask()
    with torch.no_grad():
        plain = model(pixels, pixel_mask=mask)
    before = snapshot(model)
    leaf = pixels.clone().requires_grad_()
    with get_adapter(model).propagation(model, getattr(RuleSet, preset)):
        ruled = model(leaf, pixel_mask=mask)
    assert torch.equal(ruled.logits, plain.logits)
    assert torch.equal(ruled.pred_boxes, plain.pred_boxes)
    (grad,) = torch.autograd.grad(ruled.logits[:, 2, 1].sum(), leaf)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    assert_same(before, snapshot(model))


def test_frozen_batch_norms_are_not_taken_for_layer_norms(model):
    from captum_transformers.propagation.rules.rule_set import find_norms

    names = {site.name for site in find_norms(model)}
    assert names and all("backbone" not in name for name in names)
    assert len(names) == 2 * 2 + 3 * 2 + 1  # encoder: 2 per layer; decoder: 3 per layer, + the final norm


class _RecordingExplainer:
    """Stands for an attention method: records its call, returns the target's query."""

    def __init__(self, model):
        self.model, self.adapter, self.calls = model, get_adapter(model), []

    def attribute(self, inputs, target=None, additional_forward_args=None, forward_kwargs=None, **kwargs):
        self.calls.append(dict(inputs=inputs, target=target, forward_kwargs=forward_kwargs, kwargs=kwargs))
        queries = torch.as_tensor(target)[:, 0].to(inputs.dtype)
        return queries[:, None, None, None].expand_as(inputs).clone()


def test_explain_detections_explains_each_detection_once_in_one_call(model):
    pixels, mask = images(3), padded_mask(3)
    with torch.no_grad():
        probs = model(pixels, pixel_mask=mask).logits.softmax(-1)[..., :-1]
    best, labels = probs.max(-1)
    threshold = best.median().item()  # some queries pass, some do not
    explainer = _RecordingExplainer(model)
    found = explain_detections(explainer, pixels, threshold=threshold, forward_kwargs={"pixel_mask": mask})
    passing = best > threshold
    assert 0 < len(found) == int(passing.sum()) < 3 * NUM_QUERIES
    assert len(explainer.calls) == 1
    call = explainer.calls[0]
    assert torch.equal(call["inputs"], pixels[found.image_index])
    assert torch.equal(call["forward_kwargs"]["pixel_mask"], mask[found.image_index])
    assert torch.as_tensor(call["target"]).tolist() == torch.stack([found.query_index, found.label], 1).tolist()
    assert passing[found.image_index, found.query_index].all()
    assert torch.equal(found.label, labels[found.image_index, found.query_index])
    assert torch.equal(found.score, best[found.image_index, found.query_index])
    assert found.maps.shape == (len(found), 3, 64, 48)
    assert torch.equal(found.maps[:, 0, 0, 0], found.query_index.float())


def test_explain_detections_with_threshold_zero_explains_every_query(model):
    found = explain_detections(_RecordingExplainer(model), images(2), threshold=0.0)
    assert len(found) == 2 * NUM_QUERIES
    assert found.image_index.tolist() == [0] * NUM_QUERIES + [1] * NUM_QUERIES
    assert found.query_index.tolist() == list(range(NUM_QUERIES)) * 2


def test_explain_detections_with_nothing_above_threshold_is_empty(model):
    found = explain_detections(_RecordingExplainer(model), images(2), threshold=1.0)
    assert len(found) == 0
    assert found.maps.shape == (0, 3, 64, 48)
    for field in (found.image_index, found.query_index, found.label, found.score):
        assert field.shape == (0,)


# -- end to end, through the multi-stream methods -------------------------------------------
def _self_normalised(relevance):
    """Eq. 8-9 of Chefer et al. (ICCV 2021): (R - I) / rowsum(R - I) + I (a zero row stays 0)."""
    eye = torch.eye(relevance.shape[-1], dtype=relevance.dtype)
    aggregated = relevance - eye
    sums = aggregated.sum(-1, keepdim=True)
    return torch.where(sums == 0, 0.0, aggregated / torch.where(sums == 0, 1.0, sums)) + eye


def _encoder_decoder_relevance(recorded):
    """R^{ee}, R^{dd}, R^{de} written from the paper's encoder-decoder rules (Sec. 3), one
    example at a time: self-attention R^{st} += Abar R^{st}; cross-attention
    R^{de} += (Rbar^{dd})^T Abar Rbar^{ee} (R^{ed} = 0, so R^{dd} gets nothing)."""
    batch, n_enc, n_dec = recorded.logits.shape[0], recorded.streams.layouts[ENC].num_tokens, NUM_QUERIES
    out = []
    for b in range(batch):
        ee, dd, de = torch.eye(n_enc), torch.eye(n_dec), torch.zeros(n_dec, n_enc)
        for record in recorded.records:
            abar = (record.forward_value[b] * record.backward_value[b]).clamp(min=0).mean(0)
            if record.streams == (ENC, ENC):
                ee = ee + abar @ ee
            elif record.streams == (DEC, DEC):
                dd, de = dd + abar @ dd, de + abar @ de
            else:
                de = de + _self_normalised(dd).T @ abar @ _self_normalised(ee)
        out.append((ee, dd, de))
    return out


def test_generic_attention_reads_the_querys_row_of_the_decoder_encoder_map(model):
    from captum_transformers import GenericAttention

    pixels = images()
    targets = [(3, 1), (0, 2)]
    encoder_scores, decoder_scores = GenericAttention(model).attribute(pixels, target=targets, return_tokens=True)
    reference = _encoder_decoder_relevance(trace(model, pixels, targets))
    for b, (q, _) in enumerate(targets):
        _, dd, de = reference[b]
        torch.testing.assert_close(encoder_scores[b], de[q], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(decoder_scores[b], dd[q], rtol=1e-5, atol=1e-7)
        assert de[q].abs().sum() > 0

    maps = GenericAttention(model).attribute(pixels, target=targets)
    assert maps.shape == pixels.shape and torch.isfinite(maps).all()
    grid = encoder_scores.reshape(2, 1, 8, 6)
    upsampled = torch.nn.functional.interpolate(grid, size=(64, 48), mode="bilinear", align_corners=False)
    torch.testing.assert_close(maps, upsampled.expand(-1, 3, -1, -1))


def test_different_queries_give_different_maps(model):
    from captum_transformers import GenericAttention

    pixels = images(1)
    explainer = GenericAttention(model)
    maps = [explainer.attribute(pixels, target=(q, 1)) for q in range(NUM_QUERIES)]
    for i in range(NUM_QUERIES):
        for j in range(i + 1, NUM_QUERIES):
            assert not torch.allclose(maps[i], maps[j], rtol=1e-3, atol=1e-6), (i, j)


def test_padded_images_get_zero_relevance_outside_the_image_and_the_mask_no_map(model):
    from captum_transformers import GenericAttention

    pixels, mask = images(), padded_mask()
    encoder_scores, _ = GenericAttention(model).attribute((pixels, mask), target=(1, 1), return_tokens=True)
    padding = ~trace(model, (pixels, mask), (1, 1), CaptureSpec()).streams.layouts[ENC].token_mask
    assert padding[1].any() and torch.equal(encoder_scores[padding], torch.zeros(int(padding.sum())))
    image_map, mask_map = GenericAttention(model).attribute((pixels, mask), target=(1, 1))
    assert image_map.shape == pixels.shape and torch.equal(mask_map, torch.zeros(mask.shape))


def test_explain_detections_with_generic_attention_matches_one_call_per_detection(model):
    from captum_transformers import GenericAttention

    pixels = images(2)
    explainer = GenericAttention(model)
    found = explain_detections(explainer, pixels, threshold=0.0)
    assert found.maps.shape == (2 * NUM_QUERIES, 3, 64, 48)
    for d in (0, NUM_QUERIES + 2):
        b, q, c = (int(t[d]) for t in (found.image_index, found.query_index, found.label))
        alone = explainer.attribute(pixels[b:b + 1], target=(q, c))
        torch.testing.assert_close(found.maps[d:d + 1], alone, rtol=1e-4, atol=1e-7)


def test_sdpa_model_gives_the_eager_trace():
    pixels = images()
    eager = trace(detr("eager"), pixels, (2, 1))
    sdpa_model = detr(None)  # transformers' default: sdpa
    assert sdpa_model.config._attn_implementation == "sdpa"
    sdpa = trace(sdpa_model, pixels, (2, 1))
    assert [r.streams for r in sdpa.records] == CALL_STREAMS
    for a, b in zip(eager.records, sdpa.records):
        torch.testing.assert_close(a.forward_value, b.forward_value)
        torch.testing.assert_close(a.backward_value, b.backward_value)
    assert sdpa_model.config._attn_implementation == "sdpa"


def test_relevance_methods_run_on_detr(model):
    from captum_transformers import LRP_ATTENTION_METHODS, RELEVANCE_METHODS

    pixels = images()
    for method in (*LRP_ATTENTION_METHODS, *RELEVANCE_METHODS):
        maps = method(model).attribute(pixels, target=[(2, 1), (4, 0)])
        assert maps.shape == pixels.shape and torch.isfinite(maps).all() and maps.abs().sum() > 0, method.__name__
