"""Heads that read another row than the default (issue 42): encoder-decoder classifiers and QA
heads given input_ids alone, and token-level heads of causal decoders.

* BART- and T5-style sequence classifiers run their decoder over input_ids shifted right and
  pool the decoder row of the last eos token; their QA heads score every decoder row. Every
  method explains that row (raw attention equals the model's own eager cross-attention there),
  and a right-padded batch equals the single calls: the decoder's real positions are the
  source's, though the model passes no decoder mask.
* GPT-2 / Llama token classifiers: a ``(position, label)`` target explains that position's row
  of a causal model, not the last token's next-token logits.
"""
from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from captum_transformers import InputError, RawAttention  # noqa: E402
from captum_transformers.methods.catalog import CAPTUM_BASELINES, KNOWN_METHOD_NAMES, ON_REQUEST, build_method  # noqa: E402

# Methods whose definition applies to these heads (the Captum baselines have tests of their own;
# AttentionFlow, run on request, refuses several streams).
METHODS = [name for name in KNOWN_METHOD_NAMES if name not in CAPTUM_BASELINES | ON_REQUEST]
EOS = 2


def _seq2seq(family: str, head: str):
    torch.manual_seed(0)
    if family == "bart":
        config = transformers.BartConfig(
            vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
            eos_token_id=EOS, pad_token_id=1, dropout=0.0, attention_dropout=0.0, attn_implementation="eager",
            num_labels=3)
        classes = {"cls": transformers.BartForSequenceClassification, "qa": transformers.BartForQuestionAnswering}
    else:
        config = transformers.T5Config(
            vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            eos_token_id=EOS, pad_token_id=0, decoder_start_token_id=0, dropout_rate=0.0,
            attn_implementation="eager", num_labels=3)
        classes = {"cls": transformers.T5ForSequenceClassification, "qa": transformers.T5ForQuestionAnswering}
    config.num_labels = 2 if head == "qa" else 3
    return classes[head](config).double().eval()


def _source(pad: int):
    """Two rows of 7 ids, the second real for 5 then padded; each ends with eos."""
    ids = torch.tensor([[5, 9, 12, 7, 30, 11, EOS], [6, 8, 14, 21, EOS, pad, pad]])
    return ids, (ids != pad).long()


def _first(result):
    return result[0] if isinstance(result, tuple) else result


def _quiet(method, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # blank Grad-CAM maps on random weights
        return _first(method.attribute(*args, **kwargs))


HEAD_TARGETS = {"cls": [1, 2], "qa": [(0, 3), (1, 2)]}


@pytest.mark.parametrize("family", ["bart", "t5"])
@pytest.mark.parametrize("head", sorted(HEAD_TARGETS))
@pytest.mark.parametrize("name", METHODS)
def test_encoder_decoder_head_batch_equals_single(family, head, name):
    model = _seq2seq(family, head)
    ids, mask = _source(model.config.pad_token_id)
    targets = HEAD_TARGETS[head]
    method = build_method(name, model)
    batch = _quiet(method, ids, target=targets, forward_kwargs={"attention_mask": mask})
    single = _quiet(method, ids[1:, :5], target=targets[1:], forward_kwargs={"attention_mask": mask[1:, :5]})
    assert torch.isfinite(batch).all()
    assert batch[1, 5:].abs().max() == 0  # nothing on padding
    torch.testing.assert_close(batch[1, :5], single[0], rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("family", ["bart", "t5"])
@pytest.mark.parametrize("head", sorted(HEAD_TARGETS))
def test_raw_attention_reads_the_row_the_head_reads(family, head):
    """The last cross-attention's head-mean row at the eos token (classifier) or at the target's
    position (QA), from the model's own eager maps: not the last decoder position."""
    model = _seq2seq(family, head)
    ids, mask = _source(model.config.pad_token_id)
    targets = HEAD_TARGETS[head]
    maps = RawAttention(model).attribute(ids, target=targets, forward_kwargs={"attention_mask": mask})
    encoder_map = _first(maps)
    with torch.no_grad():
        eager = model(input_ids=ids, attention_mask=mask, output_attentions=True).cross_attentions[-1].mean(1)
    rows = [6, 4] if head == "cls" else [target[1] for target in targets]
    for example, row in enumerate(rows):
        expected = eager[example, row] * mask[example]
        torch.testing.assert_close(encoder_map[example], expected, rtol=0, atol=1e-10)


def test_a_padded_qa_target_is_refused():
    model = _seq2seq("bart", "qa")
    ids, mask = _source(model.config.pad_token_id)
    with pytest.raises(InputError, match="padding"):
        RawAttention(model).attribute(ids, target=[(0, 2), (0, 6)], forward_kwargs={"attention_mask": mask})


def test_bart_generation_head_given_input_ids_alone_reads_the_last_real_decoder_row():
    """BartForConditionalGeneration run on input_ids alone (its decoder over them shifted right):
    the next-token logit at the last real position, so a padded batch equals the single calls."""
    torch.manual_seed(0)
    config = _seq2seq("bart", "cls").config
    model = transformers.BartForConditionalGeneration(config).double().eval()
    ids, mask = _source(config.pad_token_id)
    for name in ("generic-attention", "rollout", "lrp"):
        method = build_method(name, model)
        batch = _quiet(method, ids, target=[9, 9], forward_kwargs={"attention_mask": mask})
        single = _quiet(method, ids[1:, :5], target=[9], forward_kwargs={"attention_mask": mask[1:, :5]})
        torch.testing.assert_close(batch[1, :5], single[0], rtol=1e-8, atol=1e-12)


def _causal_token_classifier(family: str):
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, num_labels=3,
                                         pad_token_id=0, attn_implementation="eager", resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2ForTokenClassification(config).double().eval()
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_labels=3, pad_token_id=0,
                                      attn_implementation="eager")
    return transformers.LlamaForTokenClassification(config).double().eval()


CAUSAL_IDS = torch.tensor([[5, 9, 12, 7, 30, 11], [6, 8, 14, 21, 0, 0]])
CAUSAL_MASK = (CAUSAL_IDS != 0).long()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("name", METHODS)
def test_causal_token_classifier_explains_the_target_position(family, name):
    model = _causal_token_classifier(family)
    method = build_method(name, model)
    targets = [(2, 1), (3, 2)]
    batch = _quiet(method, CAUSAL_IDS, target=targets, forward_kwargs={"attention_mask": CAUSAL_MASK})
    single = _quiet(method, CAUSAL_IDS[1:, :4], target=targets[1:], forward_kwargs={"attention_mask": CAUSAL_MASK[1:, :4]})
    torch.testing.assert_close(batch[1, :4], single[0], rtol=1e-8, atol=1e-12)
    # A causal row reads no later token.
    assert batch[0, 3:].abs().max() == 0 and batch[1, 4:].abs().max() == 0


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_causal_token_classifier_raw_attention_is_the_eager_row(family):
    model = _causal_token_classifier(family)
    maps = RawAttention(model).attribute(CAUSAL_IDS, target=[(2, 1), (3, 2)],
                                         forward_kwargs={"attention_mask": CAUSAL_MASK})
    with torch.no_grad():
        eager = model(input_ids=CAUSAL_IDS, attention_mask=CAUSAL_MASK, output_attentions=True).attentions[-1].mean(1)
    tolerance = 1e-6 if family == "llama" else 1e-10  # Llama's eager softmax runs in float32
    torch.testing.assert_close(maps[0], eager[0, 2], rtol=0, atol=tolerance)
    torch.testing.assert_close(maps[1], eager[1, 3], rtol=0, atol=tolerance)


def test_seamless_text_to_text_streams():
    """SeamlessM4T's text encoder and decoder (``text_encoder`` / ``text_decoder``) are the two
    streams: raw attention is the model's own last cross-attention row at the last real decoder
    token, and a padded batch equals the single calls."""
    torch.manual_seed(0)
    config = transformers.SeamlessM4TConfig(
        vocab_size=64, hidden_size=32, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        encoder_attention_heads=4, decoder_attention_heads=4, max_position_embeddings=32, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=2, eos_token_id=3,
        decoder_start_token_id=3, speech_encoder_layers=1, speech_encoder_attention_heads=2,
        speech_encoder_intermediate_size=32, t2u_encoder_layers=1, t2u_decoder_layers=1, t2u_encoder_ffn_dim=32,
        t2u_decoder_ffn_dim=32, t2u_encoder_attention_heads=2, t2u_decoder_attention_heads=2,
        attn_implementation="eager")
    model = transformers.SeamlessM4TForTextToText(config).double().eval()
    source, source_mask = _source(0)
    prefix = torch.tensor([[3, 9, 11, 4], [3, 10, 0, 0]])
    prefix_mask = (prefix != 0).long()
    prefix_mask[:, 0] = 1
    kwargs = {"attention_mask": source_mask, "decoder_attention_mask": prefix_mask}
    encoder_map, _ = RawAttention(model).attribute((source, prefix), target=5, forward_kwargs=kwargs)
    with torch.no_grad():
        eager = model(input_ids=source, decoder_input_ids=prefix, output_attentions=True,
                      **kwargs).cross_attentions[-1].mean(1)
    for example, row in enumerate([3, 1]):
        torch.testing.assert_close(encoder_map[example], eager[example, row] * source_mask[example], rtol=0,
                                   atol=1e-10)
    method = build_method("generic-attention", model)
    batch = method.attribute((source, prefix), target=5, forward_kwargs=kwargs)
    single = method.attribute((source[1:, :5], prefix[1:, :2]), target=5,
                              forward_kwargs={"attention_mask": source_mask[1:, :5],
                                              "decoder_attention_mask": prefix_mask[1:, :2]})
    torch.testing.assert_close(batch[0][1, :5], single[0][0], rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(batch[1][1, :2], single[1][0], rtol=1e-8, atol=1e-12)


def _bart_lm():
    torch.manual_seed(0)
    return transformers.BartForConditionalGeneration(_seq2seq("bart", "cls").config).double().eval()


def test_bart_as_a_masked_lm_explains_the_target_decoder_row():
    """BartForConditionalGeneration given input_ids alone and a (position, token) target (BART as
    a masked LM, as transformers' fill-mask pipeline reads it): raw attention is the model's own
    last cross-attention at decoder row p (not at the last real row), each method's padded batch
    equals the single calls, and a padded position is refused."""
    model = _bart_lm()
    ids, mask = _source(model.config.pad_token_id)
    targets = [(2, 7), (3, 9)]
    encoder_map = _first(RawAttention(model).attribute(ids, target=targets, forward_kwargs={"attention_mask": mask}))
    with torch.no_grad():
        eager = model(input_ids=ids, attention_mask=mask, output_attentions=True).cross_attentions[-1].mean(1)
    for example, (row, _) in enumerate(targets):
        torch.testing.assert_close(encoder_map[example], eager[example, row] * mask[example], rtol=0, atol=1e-10)
        assert (encoder_map[example] - eager[example, -1] * mask[example]).abs().max() > 1e-4
    for name in METHODS:
        method = build_method(name, model)
        batch = _quiet(method, ids, target=targets, forward_kwargs={"attention_mask": mask})
        single = _quiet(method, ids[1:, :5], target=targets[1:], forward_kwargs={"attention_mask": mask[1:, :5]})
        assert batch[1, 5:].abs().max() == 0, name
        torch.testing.assert_close(batch[1, :5], single[0], rtol=1e-8, atol=1e-12, msg=name)
    with pytest.raises(InputError, match="padding"):
        RawAttention(model).attribute(ids, target=[(2, 7), (6, 7)], forward_kwargs={"attention_mask": mask})


def test_a_position_target_on_a_causal_lm_says_how_to_explain_that_position():
    """A causal LM is explained at its next-token position: a (position, token) target is refused
    with the way to explain position p."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config).double().eval()
    with pytest.raises(InputError, match="next-token position.*tokens before p"):
        RawAttention(model).attribute(CAUSAL_IDS, target=(2, 7), forward_kwargs={"attention_mask": CAUSAL_MASK})
