"""LXMERT and VisualBERT through the inline-attention adapter (hooks on the attention dropout).

Tiny models from configs (random weights, no hub). What is proved here:

1. registry: both families get this adapter (MRO lookup beats the generic HF adapter);
2. LXMERT: one record per attention call, stream pairs in call order (the co-attention
   module's two calls: text over image, then image over text), maps equal to the model's
   own ``output_attentions`` and, for the call the model does not return, to the module
   re-run on the vision stream's input;
3. VisualBERT: one stream over [text; visual], maps equal ``output_attentions``, VQA row;
4. padding masks per stream, batch == single, forward outputs unchanged, exact restore
   after normal exit and after an exception raised mid-forward;
5. end to end: GenericAttention on Captum-style input tuples, per-stream token scores;
6. propagation rules: tests/test_inline_attention_relevance.py.
"""
from __future__ import annotations


import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from captum_transformers import (CaptureError, CaptureSpec, ConservativeLRP, GenericAttention, InputError,  # noqa: E402
                                 RuleSet, get_adapter)
from captum_transformers.adapters.huggingface.inline_attention import InlineAttentionAdapter, _key_valid  # noqa: E402
from captum_transformers.engine.runner import run_trace
from inline_models import (B, CASES, I, KEEP, L_LAYERS, R_LAYERS, T, VIS, X_LAYERS,  # noqa: E402
                           lxmert, regions, text, visual_bert)
from restore import assert_same, raising_after, snapshot  # noqa: E402

def lxmert_call_order():
    """The (query, key) stream pairs LxmertEncoder.forward calls, in order."""
    order = [("text", "text")] * L_LAYERS + [("image", "image")] * R_LAYERS
    for _ in range(X_LAYERS):
        order += [("text", "image"), ("image", "text"), ("text", "text"), ("image", "image")]
    return order


def trace(model, inputs, kwargs, spec=KEEP, target=0):
    return run_trace(get_adapter(model), model, inputs, (), target, spec, kwargs)


# == 1. registry ===================================================================================
@pytest.mark.parametrize("build", [
    lambda: lxmert(), lambda: lxmert(transformers.LxmertForPreTraining), lambda: lxmert(transformers.LxmertModel),
    lambda: visual_bert(), lambda: visual_bert(transformers.VisualBertForQuestionAnswering),
    lambda: visual_bert(transformers.VisualBertModel)])
def test_registry_picks_the_inline_adapter_over_the_generic_one(build):
    assert isinstance(get_adapter(build()), InlineAttentionAdapter)


def test_registry_still_gives_bert_the_generic_adapter():
    model = transformers.BertModel(transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                                           intermediate_size=64))
    assert get_adapter(model).name == "huggingface"


# == 2. LXMERT: counts, stream pairs, maps =========================================================
def test_lxmert_records_every_call_with_its_stream_pair():
    model = lxmert()
    ids, mask = text()
    feats, pos = regions()
    result = trace(model, (ids, feats, pos), {"attention_mask": mask})
    assert len(result) == 2 * X_LAYERS + (L_LAYERS + R_LAYERS + 2 * X_LAYERS)
    assert [r.streams for r in result.records] == lxmert_call_order()
    sizes = {"text": T, "image": I}
    for record in result.records:
        query, key = record.streams
        assert record.forward_value.shape == (B, 4, sizes[query], sizes[key])
    assert [r.call_index for r in result.records] == list(range(len(result)))
    cross = [r for r in result.records if not r.is_self]
    assert {r.block.name for r in cross} == {f"lxmert.encoder.x_layers.{k}.visual_attention.att" for k in range(2)}
    assert all(r.block.kind == "cross" for r in cross)


def test_lxmert_maps_equal_the_models_own_attentions():
    model = lxmert()
    ids, mask = text()
    feats, pos = regions()
    visual_mask = torch.ones(B, I)
    visual_mask[2, 3:] = 0
    kwargs = {"attention_mask": mask, "visual_attention_mask": visual_mask}
    # Inputs of each cross layer, to re-run the co-attention module with vision queries.
    x_inputs = []
    hooks = [layer.register_forward_pre_hook(lambda m, args: x_inputs.append(args))
             for layer in model.lxmert.encoder.x_layers]
    with torch.no_grad():
        out = model(ids, feats, pos, output_attentions=True, **kwargs)
    for hook in hooks:
        hook.remove()
    result = trace(model, (ids, feats, pos), kwargs)
    records = {}
    for record in result.records:
        records.setdefault(record.block.name, []).append(record.forward_value)
    for k in range(L_LAYERS):
        torch.testing.assert_close(records[f"lxmert.encoder.layer.{k}.attention.self"][0], out.language_attentions[k],
                                   rtol=0, atol=0)
    for k in range(R_LAYERS):
        torch.testing.assert_close(records[f"lxmert.encoder.r_layers.{k}.attention.self"][0],
                                   out.vision_attentions[k], rtol=0, atol=0)
    for k, layer in enumerate(model.lxmert.encoder.x_layers):
        text_over_image, image_over_text = records[f"lxmert.encoder.x_layers.{k}.visual_attention.att"]
        torch.testing.assert_close(text_over_image, out.cross_encoder_attentions[k], rtol=0, atol=0)
        lang, lang_mask, vision, _ = x_inputs[k][:4]
        with torch.no_grad():
            expected = layer.visual_attention(vision, lang, lang_mask, output_attentions=True)[1]
        torch.testing.assert_close(image_over_text, expected, rtol=0, atol=0)


def test_lxmert_layouts_masks_and_input_spans():
    model = lxmert()
    ids, mask = text()
    feats, pos = regions()
    visual_mask = torch.ones(B, I, dtype=torch.long)
    visual_mask[0, 2:] = 0
    streams = trace(model, (ids, feats, pos), {"attention_mask": mask, "visual_attention_mask": visual_mask}).streams
    assert streams.explained == ("text",)
    assert streams.sizes() == {"text": T, "image": I}
    assert torch.equal(streams.layouts["text"].token_mask, mask.bool())
    assert torch.equal(streams.layouts["image"].token_mask, visual_mask.bool())
    assert torch.equal(streams.layouts["text"].query_rows, torch.zeros(B, 1, dtype=torch.long))
    assert [(s.stream, s.start, s.stop) if s else None for s in streams.inputs] == [("text", 0, T), ("image", 0, I),
                                                                                    None]
    # No visual mask: the image stream has no padding.
    assert trace(model, (ids, feats, pos), {"attention_mask": mask}).streams.layouts["image"].token_mask is None


@pytest.mark.parametrize("value", [float("-inf"), -10000.0, torch.finfo(torch.float32).min,
                                   torch.finfo(torch.float16).min])
def test_padding_read_from_every_additive_mask_convention(value):
    mask = torch.zeros(2, 1, 1, 4)
    mask[1, ..., 2:] = value
    assert _key_valid(mask).tolist() == [[True] * 4, [True, True, False, False]]


# == 3. VisualBERT ==================================================================================
def test_visual_bert_one_stream_over_text_and_visual_tokens():
    model = visual_bert()
    ids, mask = text()
    visual = torch.randn(B, I, VIS)
    visual_mask = torch.ones(B, I, dtype=torch.long)
    visual_mask[2, 3:] = 0
    kwargs = {"attention_mask": mask, "visual_embeds": visual, "visual_attention_mask": visual_mask}
    with torch.no_grad():
        out = model(ids, output_attentions=True, **kwargs)
    result = trace(model, (ids,), kwargs)
    assert len(result) == 2 and all(r.streams == ("tokens", "tokens") for r in result.records)
    for record, expected in zip(result.records, out.attentions):
        torch.testing.assert_close(record.forward_value, expected, rtol=0, atol=0)
    layout = result.streams.layouts["tokens"]
    assert layout.num_tokens == T + I
    assert torch.equal(layout.token_mask, torch.cat([mask, visual_mask], 1).bool())
    assert torch.equal(layout.query_rows, torch.zeros(B, 1, dtype=torch.long))  # the pooler reads CLS
    span, = result.streams.inputs
    assert (span.stream, span.start, span.stop) == ("tokens", 0, T)


def test_visual_bert_vqa_explains_the_token_its_head_gathers():
    # VisualBertForQuestionAnswering pools sequence_output at attention_mask.sum(1) - 2.
    model = visual_bert(transformers.VisualBertForQuestionAnswering)
    ids, mask = text()
    result = trace(model, (ids,), {"attention_mask": mask, "visual_embeds": torch.randn(B, I, VIS)})
    assert result.layout.query_rows[:, 0].tolist() == (mask.sum(1) - 2).tolist()


class VisualBertPair(nn.Module):
    """A wrapper that makes visual_embeds positional: forward(input_ids, visual_embeds, attention_mask)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, visual_embeds, attention_mask=None):
        return self.model(input_ids, attention_mask=attention_mask, visual_embeds=visual_embeds).logits


def test_visual_bert_end_to_end_by_keyword_and_through_a_positional_wrapper():
    model = visual_bert()
    ids, mask = text()
    visual = torch.randn(B, I, VIS)
    explainer = GenericAttention(model)
    kwargs = {"attention_mask": mask, "visual_embeds": visual}
    tokens = explainer.attribute(ids, target=1, forward_kwargs=kwargs, return_tokens=True)
    assert tokens.shape == (B, T + I)
    assert tokens[:, T:].abs().sum() > 0  # the visual tokens get scores
    mapped = explainer.attribute(ids, target=1, forward_kwargs=kwargs)
    assert torch.equal(mapped, tokens[:, :T])
    pair = GenericAttention(VisualBertPair(model))
    text_map, visual_map = pair.attribute((ids, visual), target=1, forward_kwargs={"attention_mask": mask})
    assert torch.equal(text_map, tokens[:, :T])
    assert visual_map.shape == visual.shape
    assert torch.equal(visual_map, tokens[:, T:, None].expand_as(visual))


# == 4. batch == single, forward unchanged, restore ===================================================


@pytest.mark.parametrize("padded", [False, True], ids=["pad-free", "padded"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_batch_equals_single(case, padded):
    """Each example of a padded batch equals the example alone with its padding cut off."""
    model, inputs, kwargs = CASES[case](padded)
    explainer = GenericAttention(model)
    targets = [0, 1, 2]
    batch = explainer.attribute(inputs, target=targets, forward_kwargs=kwargs, return_tokens=True)
    batch = batch if isinstance(batch, tuple) else (batch,)
    for i in range(B):
        n = int(kwargs["attention_mask"][i].sum())  # real text tokens
        alone_inputs = (inputs[0][i:i + 1, :n], *(t[i:i + 1] for t in inputs[1:]))
        alone_kwargs = {k: v[i:i + 1, :n] if k == "attention_mask" else v[i:i + 1] for k, v in kwargs.items()}
        single = explainer.attribute(alone_inputs, target=targets[i], return_tokens=True, forward_kwargs=alone_kwargs)
        single = single if isinstance(single, tuple) else (single,)
        if case == "lxmert":  # (text, image) streams
            torch.testing.assert_close(batch[0][i, :n], single[0][0], rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(batch[1][i], single[1][0], rtol=1e-4, atol=1e-6)
        else:  # one stream [text; visual]
            torch.testing.assert_close(batch[0][i, :n], single[0][0, :n], rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(batch[0][i, T:], single[0][0, n:], rtol=1e-4, atol=1e-6)


def test_lxmert_co_attention_directions_of_a_cross_layer_share_a_group():
    model = lxmert()
    ids, mask = text()
    feats, pos = regions()
    result = trace(model, (ids, feats, pos), {"attention_mask": mask})
    cross = [r for r in result.records if not r.is_self]
    assert [r.streams for r in cross] == [("text", "image"), ("image", "text")] * X_LAYERS
    groups = [r.group for r in cross]
    assert groups[0] == groups[1] and groups[2] == groups[3] and groups[0] != groups[2]
    assert all(r.group is None for r in result.records if r.is_self)


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_output_unchanged_under_capture(case):
    model, inputs, kwargs = CASES[case](True)
    adapter = get_adapter(model)
    with torch.no_grad():
        before = model(*inputs, **kwargs)
    from captum_transformers.capture.recorder import Recorder

    for spec in (KEEP, CaptureSpec(backward_reduce=lambda p, g, v: p * g)):
        with torch.enable_grad(), adapter.capture(model, Recorder(spec)):
            inside = model(*inputs, **kwargs)
        field = "question_answering_score" if case == "lxmert" else "logits"
        assert torch.equal(getattr(before, field), getattr(inside, field))


@pytest.mark.parametrize("case", sorted(CASES))
def test_exact_restore_after_normal_exit_and_after_an_exception(case):
    model, inputs, kwargs = CASES[case](True)
    before = snapshot(model)
    GenericAttention(model).attribute(inputs, target=0, forward_kwargs=kwargs)
    with get_adapter(model).propagation(model, RuleSet.CHEFER):
        model(*inputs, **kwargs)
    assert_same(before, snapshot(model))

    # KeyboardInterrupt is not an Exception: restore must not rely on `except Exception`.
    with raising_after(get_adapter(model).blocks(model)[-1].module, KeyboardInterrupt()):
        with pytest.raises(KeyboardInterrupt):
            GenericAttention(model).attribute(inputs, target=0, forward_kwargs=kwargs)
        with pytest.raises(KeyboardInterrupt):
            ConservativeLRP(model).attribute(inputs, target=0, forward_kwargs=kwargs)
    assert_same(before, snapshot(model))


# == 5. LXMERT end to end ==============================================================================
def test_lxmert_generic_attention_on_an_input_tuple():
    model = lxmert()
    ids, mask = text()
    feats, pos = regions()
    explainer = GenericAttention(model)
    maps = explainer.attribute((ids, feats, pos), target=[0, 1, 2], forward_kwargs={"attention_mask": mask})
    assert isinstance(maps, tuple) and [m.shape for m in maps] == [ids.shape, feats.shape, pos.shape]
    assert torch.equal(maps[2], torch.zeros_like(pos))  # box coordinates are no tokens
    text_scores, image_scores = explainer.attribute((ids, feats, pos), target=[0, 1, 2], return_tokens=True,
                                                    forward_kwargs={"attention_mask": mask})
    assert text_scores.shape == (B, T) and image_scores.shape == (B, I)
    assert torch.equal(maps[0], text_scores)
    assert torch.equal(maps[1], image_scores[:, :, None].expand_as(feats))
    assert (text_scores[1, 3:] == 0).all()  # padding
    assert (image_scores.abs().sum(1) > 0).all()  # co-attention carries relevance to the regions


def test_lxmert_score_fields_and_clear_errors():
    ids, mask = text()
    feats, pos = regions()
    inputs, kwargs = (ids, feats, pos), {"attention_mask": mask}
    pretraining = lxmert(transformers.LxmertForPreTraining)
    assert trace(pretraining, inputs, kwargs).logits.shape == (B, 3)  # question_answering_score
    with pytest.raises(InputError, match="task_qa"):
        trace(lxmert(transformers.LxmertForPreTraining, task_qa=False), inputs, kwargs)
    with pytest.raises(InputError, match="LxmertModel returns no class scores"):
        trace(lxmert(transformers.LxmertModel), inputs, kwargs)
    model = lxmert()
    plain = trace(model, inputs, {**kwargs, "return_dict": False}).logits
    assert torch.equal(plain, trace(model, inputs, kwargs).logits)
    with pytest.raises(CaptureError, match="bypass_transformer"):
        trace(visual_bert(bypass_transformer=True), (ids,), {"attention_mask": mask,
                                                             "visual_embeds": torch.randn(B, I, VIS)})
