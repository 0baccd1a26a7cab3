"""HF adapter with several token streams: CLIP's dual encoder, BART and T5 encoder-decoders,
and decoder-only LLM targets.

Checks stream pairs per call, capture counts, captured maps against the model's own
``output_attentions``, T5's relative position bias and scaling, CLIP's paired targets,
batch == single under padding, exact restore, and the attention methods end to end.
"""
from __future__ import annotations

import pytest
import torch

from captum_transformers import (ATTENTION_METHODS, LRP_ATTENTION_METHODS, RELEVANCE_METHODS, CaptureError,
                                 GenericAttention, InputError, UnsupportedModelError, get_adapter)
from captum_transformers.adapters.huggingface.kernel import captum_attention
from captum_transformers.capture.trace import CaptureSpec
from captum_transformers.engine.runner import run_trace
from hf_models import CASES
from restore import assert_same, raising_after, snapshot

transformers = pytest.importorskip("transformers")

EOS = 98
ALL_METHODS = [pytest.param(m, id=m.__name__) for m in ATTENTION_METHODS + LRP_ATTENTION_METHODS + RELEVANCE_METHODS]
RAW = CaptureSpec(forward_reduce=lambda probs: probs.clone())
FUSED = CaptureSpec(forward_reduce=lambda probs: probs.mean(1),
                    backward_reduce=lambda probs, grad, valid: (probs * grad).clamp(min=0).mean(1))


def bart(impl="eager"):
    torch.manual_seed(0)
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
        init_std=0.1, attn_implementation=impl)).eval()


def t5(impl="eager"):
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=99, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=3, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, decoder_start_token_id=0,
        attn_implementation=impl)).eval()


def clip(impl="eager"):
    torch.manual_seed(0)
    return transformers.CLIPModel(transformers.CLIPConfig(
        text_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                         vocab_size=99, max_position_embeddings=16, eos_token_id=EOS, pad_token_id=0,
                         bos_token_id=97),
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                           image_size=32, patch_size=8),
        projection_dim=6, attn_implementation=impl)).eval()


SEQ2SEQ = {"bart": bart, "t5": t5}


def seq2seq_inputs(batch=3):
    """(source ids, decoder prefix ids), forward kwargs: source 1 padded after 5 tokens,
    prefix 2 padded after 3 tokens."""
    generator = torch.Generator().manual_seed(1)
    source = torch.randint(3, 90, (batch, 7), generator=generator)
    prefix = torch.randint(3, 90, (batch, 4), generator=generator)
    source_mask = torch.ones(batch, 7, dtype=torch.long)
    prefix_mask = torch.ones(batch, 4, dtype=torch.long)
    if batch > 2:
        source_mask[1, 5:] = 0
        prefix_mask[2, 3:] = 0
    return (source, prefix), {"attention_mask": source_mask, "decoder_attention_mask": prefix_mask}


def clip_inputs(batch=3):
    """(input_ids, pixel_values), forward kwargs: text 1 padded after 5 tokens, every text
    ending in the end-of-text token."""
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 90, (batch, 7), generator=generator)
    mask = torch.ones(batch, 7, dtype=torch.long)
    ids[:, -1] = EOS
    if batch > 1:
        mask[1, 5:] = 0
        ids[1, 4] = EOS
        ids[1, 5:] = 0
    return (ids, torch.randn(batch, 3, 32, 32, generator=generator)), {"attention_mask": mask}


def trace(model, inputs, kwargs, target, spec=FUSED):
    return run_trace(get_adapter(model), model, inputs, (), target, spec, kwargs)


# -- streams ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SEQ2SEQ))
def test_encoder_decoder_streams_in_call_order(name):
    model = SEQ2SEQ[name]()
    inputs, kwargs = seq2seq_inputs()
    records = trace(model, inputs, kwargs, target=5).records
    config = model.config
    encoder_layers = config.encoder_layers if name == "bart" else config.num_layers
    decoder_layers = config.decoder_layers if name == "bart" else config.num_decoder_layers
    assert len(records) == encoder_layers + 2 * decoder_layers
    expected = [("encoder", "encoder")] * encoder_layers + [("decoder", "decoder"), ("decoder", "encoder")] * decoder_layers
    assert [r.streams for r in records] == expected
    assert [r.call_index for r in records] == list(range(len(records)))
    assert [r.block.kind for r in records] == ["self" if q == k else "cross" for q, k in expected]
    shapes = {"encoder": 7, "decoder": 4}
    for record in records:
        assert record.forward_value.shape == (3, shapes[record.streams[0]], shapes[record.streams[1]])


def test_clip_dual_encoder_streams():
    model = clip()
    inputs, kwargs = clip_inputs()
    result = trace(model, inputs, kwargs, target=None)
    # CLIPModel runs the vision tower first.
    assert [r.streams for r in result.records] == [("image", "image")] * 2 + [("text", "text")] * 2
    streams = result.streams
    assert streams.explained == ("text", "image")
    assert streams.sizes() == {"text": 7, "image": 17}
    text, image = streams.layouts["text"], streams.layouts["image"]
    assert text.query_rows[:, 0].tolist() == [6, 4, 6]  # the end-of-text token the tower pools
    assert text.token_mask.tolist() == kwargs["attention_mask"].bool().tolist()
    assert image.query_rows[:, 0].tolist() == [0, 0, 0] and image.grid == (4, 4) and image.num_prefix_tokens == 1
    assert [(s.stream, s.start, s.grid) for s in streams.inputs] == [("text", 0, None), ("image", 1, (4, 4))]
    with torch.no_grad():
        reference = model(*inputs, **kwargs).logits_per_image
    torch.testing.assert_close(result.logits, reference)


@pytest.mark.parametrize("build", [
    lambda: transformers.BertModel(transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                           intermediate_size=64, vocab_size=99)),
    lambda: CASES["clip_text"].model(),
    lambda: CASES["clip_vision"].model(),
    lambda: CASES["gpt2"].model(),
    lambda: transformers.T5ForTokenClassification(transformers.T5Config(vocab_size=99, d_model=32, d_kv=8, d_ff=64,
                                                                        num_layers=2, num_heads=4, num_labels=3)),
    lambda: transformers.BartForCausalLM(transformers.BartConfig(vocab_size=99, d_model=32, decoder_layers=2,
                                                                 decoder_attention_heads=4, decoder_ffn_dim=64,
                                                                 max_position_embeddings=32)),
], ids=["bert", "clip_text", "clip_vision", "gpt2", "t5_encoder", "bart_causal_lm"])
def test_one_sequence_models_keep_the_tokens_stream(build):
    model = build().eval()
    adapter = get_adapter(model)
    assert all(b.streams is None for b in adapter.blocks(model))
    inputs = torch.randn(2, 3, 32, 32) if "Vision" in type(model).__name__ else torch.randint(3, 90, (2, 7))
    # Bare encoders return features, whose arg-max (target=None) is refused: explain feature 0.
    bare = type(model).__name__ in ("BertModel", "CLIPTextModelWithProjection", "CLIPVisionModelWithProjection")
    result = run_trace(adapter, model, (inputs,), (), 0 if bare else None, RAW)
    assert result.streams.is_single and result.streams.explained == ("tokens",)
    assert {r.streams for r in result.records} == {("tokens", "tokens")}


# -- captured maps are the model's ---------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SEQ2SEQ))
def test_encoder_decoder_maps_equal_output_attentions(name):
    model = SEQ2SEQ[name]()
    (source, prefix), kwargs = seq2seq_inputs()
    with torch.no_grad():
        out = model(source, decoder_input_ids=prefix, output_attentions=True, **kwargs)
    expected = list(out.encoder_attentions)
    for self_map, cross_map in zip(out.decoder_attentions, out.cross_attentions):
        expected += [self_map, cross_map]
    records = trace(model, (source, prefix), kwargs, target=5, spec=RAW).records
    assert len(records) == len(expected)
    for record, reference in zip(records, expected):
        torch.testing.assert_close(record.forward_value, reference, rtol=1e-5, atol=1e-6)


def test_clip_maps_equal_output_attentions():
    model = clip()
    inputs, kwargs = clip_inputs()
    with torch.no_grad():
        out = model(*inputs, output_attentions=True, **kwargs)
    expected = list(out.vision_model_output.attentions) + list(out.text_model_output.attentions)
    records = trace(model, inputs, kwargs, target=None, spec=RAW).records
    for record, reference in zip(records, expected):
        torch.testing.assert_close(record.forward_value, reference, rtol=1e-5, atol=1e-6)


def test_t5_relative_bias_and_unit_scaling_reach_the_kernel():
    """Recompute T5's first encoder map by hand: softmax(Q K^T * 1.0 + bias + mask)."""
    model = t5()
    (source, prefix), kwargs = seq2seq_inputs()
    captured = trace(model, (source, prefix), kwargs, target=5, spec=RAW).records[0].forward_value
    layer = model.encoder.block[0].layer[0]
    attention = layer.SelfAttention
    batch, length = source.shape
    with torch.no_grad():
        hidden = layer.layer_norm(model.encoder.embed_tokens(source))
        q = attention.q(hidden).view(batch, length, 4, 8).transpose(1, 2)
        k = attention.k(hidden).view(batch, length, 4, 8).transpose(1, 2)
        bias = attention.compute_bias(length, length)
        mask = (1 - kwargs["attention_mask"][:, None, None, :].float()) * torch.finfo(torch.float32).min
        logits = q @ k.transpose(-1, -2)
        manual = torch.softmax(logits + bias + mask, dim=-1)
        no_bias = torch.softmax(logits + mask, dim=-1)
        scaled = torch.softmax(logits * 8 ** -0.5 + bias + mask, dim=-1)
    assert attention.scaling == 1.0
    torch.testing.assert_close(captured, manual, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(captured, no_bias, atol=1e-3), "the relative position bias must change the map"
    assert not torch.allclose(captured, scaled, atol=1e-3), "T5 does not scale by 1/sqrt(d)"


def test_sinks_computed_from_the_input_are_refused():
    """Per-head sink logits (GPT-OSS) are explained (tests/test_attention_sinks.py); sinks shaped
    per query, computed from the tokens (Inkling2), would carry relevance of their own."""
    q = k = v = torch.randn(1, 2, 3, 4)
    with pytest.raises(UnsupportedModelError, match="sink"):
        captum_attention(torch.nn.Linear(1, 1), q, k, v, None, sinks=torch.zeros(1, 2, 3, 1))


@pytest.mark.parametrize("name", sorted(SEQ2SEQ))
def test_forward_unchanged_and_logits_at_the_last_real_decoder_token(name):
    model = SEQ2SEQ[name]("sdpa")
    (source, prefix), kwargs = seq2seq_inputs()
    with torch.no_grad():
        full = model(source, decoder_input_ids=prefix, **kwargs).logits
    result = trace(model, (source, prefix), kwargs, target=5)
    assert result.streams.explained == ("decoder",)
    assert result.streams.layouts["decoder"].query_rows[:, 0].tolist() == [3, 3, 2]
    assert result.streams.layouts["encoder"].token_mask.tolist() == kwargs["attention_mask"].bool().tolist()
    torch.testing.assert_close(result.logits, full[torch.arange(3), torch.tensor([3, 3, 2])], rtol=1e-5, atol=1e-6)


# -- seq2seq inputs and targets -------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SEQ2SEQ))
def test_decoder_input_routes(name):
    """(input_ids, decoder_input_ids) as inputs == decoder ids by keyword; the encoder mask
    may come positionally through additional_forward_args; giving the prefix twice raises."""
    model = SEQ2SEQ[name]()
    (source, prefix), kwargs = seq2seq_inputs()
    adapter = get_adapter(model)
    as_inputs = run_trace(adapter, model, (source, prefix), (), 5, FUSED, kwargs)
    by_keyword = run_trace(adapter, model, (source,), (), 5, FUSED, {**kwargs, "decoder_input_ids": prefix})
    positional_mask = run_trace(adapter, model, (source, prefix), (kwargs["attention_mask"],), 5, FUSED,
                                    {"decoder_attention_mask": kwargs["decoder_attention_mask"]})
    assert len(as_inputs.streams.inputs) == 2 and len(by_keyword.streams.inputs) == 1
    for other in (by_keyword, positional_mask):
        torch.testing.assert_close(as_inputs.logits, other.logits)
        for a, b in zip(as_inputs.records, other.records):
            torch.testing.assert_close(a.backward_value, b.backward_value)
    with pytest.raises(InputError, match="given twice"):
        run_trace(adapter, model, (source, prefix), (), 5, FUSED, {**kwargs, "decoder_input_ids": prefix})


@pytest.mark.parametrize("name", sorted(SEQ2SEQ))
def test_generated_token_target_and_truncated_prefix(name):
    """The target is the id of the next token; an earlier generated token is explained by
    truncating the prefix, which reads the logits at that earlier position."""
    model = SEQ2SEQ[name]()
    (source, prefix), kwargs = seq2seq_inputs()
    explainer = GenericAttention(model)
    with torch.no_grad():
        full = model(source, decoder_input_ids=prefix, attention_mask=kwargs["attention_mask"]).logits
    truncated = explainer.trace((source, prefix[:, :2]), target=7, forward_kwargs={"attention_mask": kwargs["attention_mask"]})
    torch.testing.assert_close(truncated.logits, full[:, 1], rtol=1e-5, atol=1e-6)
    maps = {t: explainer.attribute((source, prefix), target=t, forward_kwargs=kwargs) for t in (5, 7)}
    source_5, prefix_5 = maps[5]
    assert source_5.shape == source.shape and prefix_5.shape == prefix.shape
    assert not torch.allclose(source_5, maps[7][0]), "the source map must depend on the explained token"
    assert (source_5[1, 5:] == 0).all() and (prefix_5[2, 3:] == 0).all(), "padding gets no relevance"


# -- CLIP targets ----------------------------------------------------------------------------
def test_clip_targets_pair_images_with_texts():
    model = clip()
    inputs, kwargs = clip_inputs()
    with torch.no_grad():
        similarity = model(*inputs, **kwargs).logits_per_image
    diagonal = trace(model, inputs, kwargs, target=None)
    assert diagonal.target[:, 0].tolist() == [0, 1, 2]
    permuted = trace(model, inputs, kwargs, target=[2, 0, 1])
    assert permuted.target[:, 0].tolist() == [2, 0, 1]
    with pytest.raises(InputError, match=r"not a permutation.*target=list\(range\(3\)\)"):
        trace(model, inputs, kwargs, target=[0, 0, 1])
    with pytest.raises(InputError, match="not a permutation"):
        trace(model, inputs, kwargs, target=1)
    explainer = GenericAttention(model)
    text_0, _ = explainer.attribute(inputs, target=None, forward_kwargs=kwargs, return_tokens=True)
    text_p, _ = explainer.attribute(inputs, target=[2, 0, 1], forward_kwargs=kwargs, return_tokens=True)
    # Text 1 is now explained for image 2 (not image 1): its map changes.
    assert not torch.allclose(text_0[1], text_p[1])
    assert similarity.shape == (3, 3)


def test_clip_start_layer_counts_per_tower():
    model = clip()
    inputs, kwargs = clip_inputs()
    all_layers = GenericAttention(model).attribute(inputs, forward_kwargs=kwargs, return_tokens=True)
    last_layer = GenericAttention(model, start_layer=1).attribute(inputs, forward_kwargs=kwargs, return_tokens=True)
    assert not torch.allclose(all_layers[1], last_layer[1])
    with pytest.raises(InputError, match="start_layer"):
        GenericAttention(model, start_layer=2).attribute(inputs, forward_kwargs=kwargs)


# -- methods end to end ------------------------------------------------------------------------
@pytest.mark.parametrize("method", ALL_METHODS)
def test_methods_on_clip_dual_encoder(method):
    model = clip()
    inputs, kwargs = clip_inputs()
    text, image = method(model).attribute(inputs, forward_kwargs=kwargs)
    assert text.shape == inputs[0].shape and image.shape == inputs[1].shape
    assert torch.isfinite(text).all() and torch.isfinite(image).all()
    assert (text[1, 5:] == 0).all()
    if method.__name__ != "AttentionGradCAM":
        assert text.abs().sum() > 0 and image.abs().sum() > 0


@pytest.mark.parametrize("name", sorted(SEQ2SEQ))
@pytest.mark.parametrize("method", ALL_METHODS)
def test_methods_on_encoder_decoders(name, method):
    model = SEQ2SEQ[name]()
    (source, prefix), kwargs = seq2seq_inputs()
    source_map, prefix_map = method(model).attribute((source, prefix), target=5, forward_kwargs=kwargs)
    assert source_map.shape == source.shape and prefix_map.shape == prefix.shape
    assert torch.isfinite(source_map).all() and torch.isfinite(prefix_map).all()
    assert (source_map[1, 5:] == 0).all() and (prefix_map[2, 3:] == 0).all()
    tokens = method(model).attribute((source, prefix), target=5, forward_kwargs=kwargs, return_tokens=True)
    assert [tuple(t.shape) for t in tokens] == [(3, 7), (3, 4)]


def test_vision_encoder_decoder_maps_the_image_grid():
    encoder = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                     image_size=32, patch_size=8)
    decoder = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=99, n_positions=16, bos_token_id=0,
                                      eos_token_id=0, add_cross_attention=True, is_decoder=True)
    model = transformers.VisionEncoderDecoderModel(
        transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)).eval()
    pixels, prefix = torch.randn(2, 3, 32, 32), torch.randint(3, 90, (2, 4))
    result = GenericAttention(model).trace((pixels, prefix), target=5)
    assert [r.streams for r in result.records] == [("encoder", "encoder")] * 2 + [("decoder", "decoder"),
                                                                                 ("decoder", "encoder")] * 2
    encoder_layout = result.streams.layouts["encoder"]
    assert encoder_layout.grid == (4, 4) and encoder_layout.num_prefix_tokens == 1
    image_map, prefix_map = GenericAttention(model).attribute((pixels, prefix), target=5)
    assert image_map.shape == pixels.shape and prefix_map.shape == prefix.shape
    assert image_map.abs().sum() > 0 and prefix_map.abs().sum() > 0


def _trim(kwargs, i, source_len, prefix_len):
    return {"attention_mask": kwargs["attention_mask"][i:i + 1, :source_len],
            "decoder_attention_mask": kwargs["decoder_attention_mask"][i:i + 1, :prefix_len]}


@pytest.mark.parametrize("name", sorted(SEQ2SEQ))
@pytest.mark.parametrize("method", ALL_METHODS)
def test_encoder_decoder_batch_equals_single_unpadded(name, method):
    # float64: the LRP rules' divisions leave float32 rounding of ~1e-4 on scores of ~5.
    model = SEQ2SEQ[name]().double()
    (source, prefix), kwargs = seq2seq_inputs()
    targets = [5, 11, 17]
    explainer = method(model)
    batched = explainer.attribute((source, prefix), target=targets, forward_kwargs=kwargs, return_tokens=True)
    for i, (n_source, n_prefix) in enumerate([(7, 4), (5, 4), (7, 3)]):
        single = explainer.attribute((source[i:i + 1, :n_source], prefix[i:i + 1, :n_prefix]), target=targets[i],
                                     forward_kwargs=_trim(kwargs, i, n_source, n_prefix), return_tokens=True)
        torch.testing.assert_close(batched[0][i:i + 1, :n_source], single[0], rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(batched[1][i:i + 1, :n_prefix], single[1], rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("method", ALL_METHODS)
def test_clip_batch_equals_single_unpadded(method):
    model = clip().double()
    (ids, pixels), kwargs = clip_inputs()
    pixels = pixels.double()
    explainer = method(model)
    text, image = explainer.attribute((ids, pixels), forward_kwargs=kwargs, return_tokens=True)
    for i, length in enumerate([7, 5, 7]):
        single = explainer.attribute((ids[i:i + 1, :length], pixels[i:i + 1]), return_tokens=True,
                                     forward_kwargs={"attention_mask": kwargs["attention_mask"][i:i + 1, :length]})
        torch.testing.assert_close(text[i:i + 1, :length], single[0], rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(image[i:i + 1], single[1], rtol=1e-9, atol=1e-10)


# -- restore -------------------------------------------------------------------------------------
class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("name", ["bart", "t5", "clip"])
@pytest.mark.parametrize("mid_forward_error", [False, True], ids=["normal_exit", "exception_mid_forward"])
def test_exact_restore(name, mid_forward_error):
    model = {"clip": clip, **SEQ2SEQ}[name]("sdpa")
    inputs, kwargs = clip_inputs() if name == "clip" else seq2seq_inputs()
    target = None if name == "clip" else 5

    def run():
        with torch.no_grad():
            return model(inputs[0], **({"pixel_values": inputs[1]} if name == "clip" else {"decoder_input_ids": inputs[1]}),
                         **kwargs)[0]

    before_out = run()
    before = snapshot(model)
    if mid_forward_error:
        with raising_after(get_adapter(model).blocks(model)[-1].module, Boom("raised mid-forward")):
            with pytest.raises(Boom):
                GenericAttention(model).attribute(inputs, target=target, forward_kwargs=kwargs)
    else:
        GenericAttention(model).attribute(inputs, target=target, forward_kwargs=kwargs)
    assert_same(before, snapshot(model))
    assert torch.equal(before_out, run())


# -- decoder-only LLMs: the generated token as target --------------------------------------------
def _left_padded(ids, mask):
    """Example 1 moved to the right end of its row, padding in front."""
    ids, mask = ids.clone(), mask.clone()
    length = int(mask[1].sum())
    ids[1] = torch.cat([torch.zeros(ids.shape[1] - length, dtype=ids.dtype), ids[1, :length]])
    mask[1] = torch.cat([torch.zeros(ids.shape[1] - length, dtype=mask.dtype), mask[1, :length]])
    return ids, mask


@pytest.mark.parametrize("case", ["gpt2", "llama_gqa"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_decoder_target_token_is_class_specific(case, side):
    spec = CASES[case]
    model = spec.model()
    ids, kwargs = spec.inputs()
    mask = kwargs["attention_mask"]
    if side == "left":
        ids, mask = _left_padded(ids, mask)
    kwargs = {"attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
    explainer = GenericAttention(model)
    result = explainer.trace(ids, target=5, forward_kwargs=kwargs)
    assert result.layout.query_rows[:, 0].tolist() == [6, 6 if side == "left" else 4, 6]
    first = explainer.attribute(ids, target=5, forward_kwargs=kwargs, return_tokens=True)
    second = explainer.attribute(ids, target=40, forward_kwargs=kwargs, return_tokens=True)
    assert not torch.allclose(first, second), "the map must depend on the explained token id"
    real = mask.bool()
    assert (first[~real] == 0).all()
    alone = explainer.attribute(ids[1:2][real[1:2]].unsqueeze(0), target=5, return_tokens=True)
    torch.testing.assert_close(first[1][real[1]].unsqueeze(0), alone, rtol=1e-4, atol=1e-6)
