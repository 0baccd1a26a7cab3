"""Text families with inline softmax attention, observed by the HuggingFace adapter
(captum_transformers/adapters/huggingface/inline_text.py).

Per family: the captured maps equal the model's eager ``output_attentions`` (float64, 1e-10),
the padded example of a batch gives the maps of the same example alone, the key mask and the
causal flag are read right; a few heads run end to end (GenericAttention on BLOOM, Megatron-BERT,
RoFormer QA, FSMT), ConservativeLRP AH+LN conserves on bias-free models, the forward pass is
bit-identical under the rules and the model is restored; the families that are no plain softmax
attention over the sequence are refused by name. The tiny float64 models come from the coverage
harness's shrunk configs (benchmarks/coverage/shrink.py), built offline.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.coverage import shrink  # noqa: E402
from captum_transformers import CaptureSpec, ConservativeLRP, GenericAttention, RawAttention, RuleSet  # noqa: E402
from captum_transformers.adapters import HuggingFaceAdapter  # noqa: E402
from captum_transformers.capture.recorder import Recorder  # noqa: E402
from captum_transformers.errors import InputError, UnsupportedModelError  # noqa: E402
from restore import assert_same, snapshot  # noqa: E402

B, N, REAL = 2, 6, 4  # batch, tokens, real tokens of the padded example 1
# model type -> (class, causal): every family of inline_text.FAMILIES but BigBird's full mode (below).
CASES = {
    "bloom": ("BloomForCausalLM", True),
    "falcon": ("FalconForCausalLM", True),
    "gpt_neo": ("GPTNeoForCausalLM", True),
    "mpt": ("MptForCausalLM", True),
    "megatron-bert": ("MegatronBertForSequenceClassification", False),
    "roformer": ("RoFormerForQuestionAnswering", False),
    "rembert": ("RemBertForCausalLM", True),
    "mpnet": ("MPNetForMaskedLM", False),
    "tapas": ("TapasForSequenceClassification", False),
    "squeezebert": ("SqueezeBertForSequenceClassification", False),
    "xlm": ("XLMForSequenceClassification", False),
    "flaubert": ("FlaubertForTokenClassification", False),
    "openai-gpt": ("OpenAIGPTLMHeadModel", True),
    "ibert": ("IBertForSequenceClassification", False),
    "luke": ("LukeForMaskedLM", False),
    "deberta": ("DebertaForSequenceClassification", False),
    "deberta-v2": ("DebertaV2ForQuestionAnswering", False),
    "mvp": ("MvpForCausalLM", True),
    "trocr": ("TrOCRForCausalLM", True),
    "gpt_neox_japanese": ("GPTNeoXJapaneseForCausalLM", True),
    "xlnet": ("XLNetForSequenceClassification", False),  # sequence-first states, content stream alone
    # Decoder-only: its attention runs through the kernel; the inline row makes its causal mask visible.
    "bigbird_pegasus": ("BigBirdPegasusForCausalLM", True),
}
# Sizes the harness's shrinker leaves large (XLM's emb_dim, LUKE's entity vocabulary): smaller here, for speed.
SMALLER = {"xlm": {"emb_dim": 32}, "flaubert": {"emb_dim": 32}, "luke": {"entity_vocab_size": 16, "entity_emb_size": 16}}
HEADS = {"ForCausalLM": "causal-lm", "LMHeadModel": "causal-lm", "ForSequenceClassification": "sequence-classification",
         "ForQuestionAnswering": "question-answering", "ForQuestionAnsweringSimple": "question-answering",
         "ForMaskedLM": "masked-lm",
         "ForTokenClassification": "token-classification", "ForConditionalGeneration": "seq2seq-lm"}
# Families that take the softmax in float32 (then cast back): a batch changes their maps by float32 roundings.
FLOAT32_SOFTMAX = {"bloom", "mpt", "xlm", "flaubert"}
KEEP = CaptureSpec(forward_reduce=lambda probs: probs)


def build(model_type, class_name, **config):
    head = next(h for suffix, h in HEADS.items() if class_name.endswith(suffix))
    small = shrink.small_config(model_type, class_name, head)
    for key, value in {**SMALLER.get(model_type, {}), **config}.items():
        setattr(small, key, value)
    return shrink.build_model(small, class_name)


def batch(vocab=100, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (B, N), generator=generator)
    mask = torch.ones(B, N, dtype=torch.long)
    mask[1, REAL:] = 0
    return ids, mask


def captured(model, inputs, kwargs):
    recorder = Recorder(KEEP)
    HuggingFaceAdapter().captured_forward(model, inputs, (), kwargs, recorder)
    return recorder


def eager_maps(model, inputs, kwargs):
    """The model's own maps in call order (encoder layers; then per decoder layer self, cross)."""
    names = ("input_ids", "decoder_input_ids")
    output = model(**dict(zip(names, inputs)), **kwargs, output_attentions=True)
    if getattr(output, "encoder_attentions", None) is not None:
        decoder = [a for pair in zip(output.decoder_attentions, output.cross_attentions) for a in pair]
        return list(output.encoder_attentions) + decoder
    maps = list(output.attentions)
    if isinstance(model, transformers.SqueezeBertPreTrainedModel):
        maps = [scores.softmax(-1) for scores in maps]  # SqueezeBERT returns the scores before the softmax
    return maps


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    model_type = request.param
    class_name, causal = CASES[model_type]
    model = build(model_type, class_name)
    return model_type, model, causal


def test_captured_maps_equal_eager_output_attentions(case):
    model_type, model, causal = case
    ids, mask = batch(model.config.vocab_size)
    with torch.no_grad():
        reference = eager_maps(model, (ids,), {"attention_mask": mask})
    recorder = captured(model, (ids,), {"attention_mask": mask})
    maps = [site.forward_value for site in recorder.sites]
    assert len(maps) == len(reference) > 0, model_type
    for site, ours, theirs in zip(recorder.sites, maps, reference):
        assert ours.dtype == torch.float64 and ours.shape == theirs.shape, (model_type, site.block.name)
        assert (ours - theirs).abs().max() <= 1e-10, (model_type, site.block.name)
    assert torch.equal(recorder.stream_mask("tokens"), mask.bool()), model_type
    assert recorder.causal is causal, model_type


def test_padded_example_gives_the_maps_of_the_example_alone(case):
    model_type, model, _ = case
    ids, mask = batch(model.config.vocab_size)
    padded = captured(model, (ids,), {"attention_mask": mask})
    single = captured(model, (ids[1:, :REAL],), {"attention_mask": mask[1:, :REAL]})
    assert single.stream_mask("tokens") is None or bool(single.stream_mask("tokens").all())
    for ours, alone in zip(padded.sites, single.sites):
        part = ours.forward_value[1:, :, :REAL, :REAL]
        tolerance = 1e-6 if model_type in FLOAT32_SOFTMAX else 1e-10
        assert (part - alone.forward_value).abs().max() <= tolerance, (model_type, ours.block.name)
        assert ours.forward_value[1:, :, :REAL, REAL:].abs().max() <= 1e-12  # padding keys get nothing


@pytest.mark.parametrize("model_type,class_name", [("fsmt", "FSMTForConditionalGeneration"),
                                                   ("mvp", "MvpForConditionalGeneration"),
                                                   ("bigbird_pegasus", "BigBirdPegasusForConditionalGeneration"),
                                                   ("nllb-moe", "NllbMoeForConditionalGeneration")])
def test_seq2seq_family_maps_and_streams(model_type, class_name):
    model = build(model_type, class_name)
    ids, mask = batch(getattr(model.config, "src_vocab_size", None) or model.config.vocab_size)
    prefix = ids[:, :4]
    # FSMT masks its decoder causally only with use_cache=False (float32: in float64 transformers 5.24
    # cannot build that mask); below the decoder running without it is refused.
    if model_type == "fsmt":
        model = model.float()
    kwargs = {"attention_mask": mask, "use_cache": False}
    with torch.no_grad():
        reference = eager_maps(model, (ids, prefix), kwargs)
    recorder = captured(model, (ids, prefix), kwargs)
    assert [s.streams for s in recorder.sites[:3]] == [("encoder", "encoder")] * 2 + [("decoder", "decoder")]
    assert recorder.sites[3].streams == ("decoder", "encoder")
    assert len(recorder.sites) == len(reference)
    for site, theirs in zip(recorder.sites, reference):
        assert (site.forward_value - theirs).abs().max() <= 1e-10, site.block.name
    assert torch.equal(recorder.stream_mask("encoder"), mask.bool())
    assert recorder.causal is True
    # One decoder token (generation's first step): nothing to be causal about, explained.
    assert len(captured(model, (ids, prefix[:, :1]), kwargs).sites) == len(reference)
    if model_type == "fsmt":
        with pytest.raises(UnsupportedModelError, match="without a causal mask"):
            captured(model, (ids, prefix), {"attention_mask": mask})
    scores = GenericAttention(model).attribute((ids, prefix), target=3, forward_kwargs=kwargs)
    assert scores[0].shape == ids.shape and scores[0][1, REAL:].abs().max() == 0
    assert scores[1].shape == prefix.shape and scores[0].abs().sum() > 0


def test_falcon_alibi_and_big_bird_full_attention():
    for model_type, class_name, config in (("falcon", "FalconForCausalLM", {"alibi": True}),
                                           ("big_bird", "BigBirdForSequenceClassification",
                                            {"attention_type": "original_full"})):
        model = build(model_type, class_name, **config)
        ids, mask = batch(model.config.vocab_size)
        with torch.no_grad():
            reference = eager_maps(model, (ids,), {"attention_mask": mask})
        recorder = captured(model, (ids,), {"attention_mask": mask})
        assert len(recorder.sites) == len(reference)
        for site, theirs in zip(recorder.sites, reference):
            assert (site.forward_value - theirs).abs().max() <= 1e-10, (model_type, site.block.name)
        assert recorder.causal is (model_type == "falcon")


@pytest.mark.parametrize("model_type,class_name,target", [
    ("bloom", "BloomForCausalLM", 7), ("megatron-bert", "MegatronBertForSequenceClassification", 1),
    ("roformer", "RoFormerForQuestionAnswering", (0, 2)),
])
def test_heads_run_end_to_end_and_restore_the_model(model_type, class_name, target):
    model = build(model_type, class_name)
    ids, mask = batch(model.config.vocab_size)
    before = snapshot(model)
    with torch.no_grad():
        plain = model(ids, attention_mask=mask)
    scores = GenericAttention(model).attribute(ids, target=target, forward_kwargs={"attention_mask": mask})
    assert scores.shape == ids.shape and bool(torch.isfinite(scores).all())
    assert scores[1, REAL:].abs().max() == 0 and scores.abs().sum() > 0
    # The padded example explained alone gives the same map (the causal LM reads its last real token).
    alone = GenericAttention(model).attribute(ids[1:, :REAL], target=target)
    assert (scores[1:, :REAL] - alone).abs().max() <= (1e-6 if model_type in FLOAT32_SOFTMAX else 1e-10)
    assert_same(before, snapshot(model))
    with torch.no_grad():
        again = model(ids, attention_mask=mask)
    field = "logits" if "logits" in plain else "start_logits"
    assert torch.equal(plain[field], again[field])


@pytest.mark.parametrize("model_type,class_name,query", [
    ("bloom", "BloomForCausalLM", "transformer.h.1.self_attention.query_key_value.weight"),
    ("megatron-bert", "MegatronBertForSequenceClassification", "bert.encoder.layer.1.attention.self.query.weight"),
])
def test_the_ah_gate_makes_the_inline_map_a_constant_and_the_forward_stays_bit_identical(model_type, class_name,
                                                                                          query):
    """Under the AH gate no gradient reaches the last layer's queries (through A): only V carries
    it. BLOOM's fused query-key-value weight still gets the value part, so its query rows are read."""
    model = build(model_type, class_name)
    ids, mask = batch(model.config.vocab_size)
    weight = model.get_parameter(query)
    rows = slice(None) if model_type == "megatron-bert" else _bloom_query_rows(model)
    with torch.no_grad():
        plain = model(ids, attention_mask=mask).logits
    for rules, moves in ((RuleSet.GRADIENT, True), (RuleSet.AH, False), (RuleSet.AH_LN, False)):
        with torch.enable_grad(), HuggingFaceAdapter().propagation(model, rules):
            logits = model(ids, attention_mask=mask).logits
            grad, = torch.autograd.grad(logits[..., 1].sum(), weight, allow_unused=True)
        assert torch.equal(logits.detach(), plain), rules.name
        assert (grad is not None and bool(grad[rows].abs().max() > 0)) is moves, rules.name


def _bloom_query_rows(model):
    """BLOOM's query_key_value rows of the queries: per head, (query, key, value) blocks of head_dim."""
    heads, width = model.config.n_head, model.config.hidden_size
    head_dim = width // heads
    return torch.cat([torch.arange(h * 3 * head_dim, h * 3 * head_dim + head_dim) for h in range(heads)])


class _BiasFreeHead(nn.Module):
    """A family's bare encoder or decoder with a bias-free linear head on one token."""

    def __init__(self, body, row):
        super().__init__()
        self.body, self.row = body, row
        torch.manual_seed(1)
        self.head = nn.Linear(body.config.hidden_size, 3, bias=False).double()

    def forward(self, input_ids):
        return self.head(self.body(input_ids).last_hidden_state[:, self.row])


def _bias_free(model):
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.zero_()
            elif "norm" in name.lower() and parameter.dim() == 1:
                parameter.copy_(torch.linspace(0.5, 1.5, parameter.numel(), dtype=parameter.dtype))
    return model


@pytest.mark.parametrize("model_type,class_name,row", [
    ("megatron-bert", "MegatronBertModel", 0), ("roformer", "RoFormerModel", 0), ("gpt_neo", "GPTNeoModel", -1),
])
def test_conservative_lrp_ah_ln_conserves_on_bias_free_models(model_type, class_name, row):
    small = shrink.small_config(model_type, class_name)
    for name in ("hidden_act", "activation_function"):
        if hasattr(small, name):
            setattr(small, name, "relu")
    body = _bias_free(shrink.build_model(small, class_name))
    model = _BiasFreeHead(body, row).eval()
    ids = torch.randint(5, small.vocab_size, (B, N), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids)[:, 1]
    relevance = ConservativeLRP(model, "AH+LN").attribute(ids, target=1, return_tokens=True)
    assert relevance.shape == (B, N)
    error = ((relevance.sum(-1) - logits).abs() / logits.abs()).max()
    assert error <= 1e-6, (model_type, error)


@pytest.mark.parametrize("model_type,class_name,config,named", [
    ("longformer", "LongformerForSequenceClassification", {}, "Longformer"),
    ("nystromformer", "NystromformerForSequenceClassification", {}, "Nystrom attention"),
    ("cpmant", "CpmAntForCausalLM", {}, "CPM-Ant"),
    ("bigbird_pegasus", "BigBirdPegasusForSequenceClassification", {"attention_type": "block_sparse"}, "block_sparse"),
    ("pegasus_x", "PegasusXForConditionalGeneration", {}, "Pegasus-X"),
    ("longt5", "LongT5ForConditionalGeneration", {}, "LongT5 local"),
    ("longt5", "LongT5ForConditionalGeneration", {"encoder_attention_type": "transient-global"},
     "LongT5 transient-global"),
    ("convbert", "ConvBertForSequenceClassification", {}, "ConvBERT"),
    ("funnel", "FunnelForSequenceClassification", {}, "Funnel"),
    ("yoso", "YosoForSequenceClassification", {}, "YOSO attention"),
    ("deberta", "DebertaForSequenceClassification", {"talking_head": True}, "talking_head"),
    ("ibert", "IBertForSequenceClassification", {"quant_mode": True}, "quant_mode"),
])
def test_families_that_are_no_plain_softmax_attention_are_refused_by_name(model_type, class_name, config, named):
    model = build(model_type, class_name, **config)
    ids, mask = batch(model.config.vocab_size)
    with pytest.raises(UnsupportedModelError, match=named):
        GenericAttention(model).attribute(ids, target=1, forward_kwargs={"attention_mask": mask})
    with pytest.raises(UnsupportedModelError, match=named):
        ConservativeLRP(model, "AH+LN").attribute(ids, target=1, forward_kwargs={"attention_mask": mask})


def test_inputs_that_add_tokens_outside_the_sequence_are_refused_by_name():
    luke = build("luke", "LukeForMaskedLM")
    ids, mask = batch(luke.config.vocab_size)
    entities = {"entity_ids": torch.ones(B, 2, dtype=torch.long), "entity_attention_mask": torch.ones(B, 2),
                "entity_position_ids": torch.zeros(B, 2, 1, dtype=torch.long), "attention_mask": mask}
    with pytest.raises(UnsupportedModelError, match="entity"):
        GenericAttention(luke).attribute(ids, target=(1, 3), forward_kwargs=entities)
    mvp = build("mvp", "MvpForConditionalGeneration", use_prompt=True, prompt_length=3, prompt_mid_dim=16)
    with pytest.raises(UnsupportedModelError, match="use_prompt"):
        GenericAttention(mvp).attribute((ids, ids[:, :3]), target=3, forward_kwargs={"attention_mask": mask})


@pytest.mark.parametrize("class_name,target", [("XLMWithLMHeadModel", (2, 7)), ("XLMForQuestionAnsweringSimple", (0, 2)),
                                               ("FlaubertWithLMHeadModel", (2, 7))])
def test_xlm_token_level_heads_read_the_target_row(class_name, target):
    """XLM / FlauBERT's masked-LM head (``WithLMHeadModel``, non-causal) and simple QA head score
    every position: raw attention is the eager head-mean row of the target's token, not row 0,
    and no next-token position is kept."""
    model_type = "xlm" if class_name.startswith("XLM") else "flaubert"
    model = build(model_type, class_name)
    ids, mask = batch()
    maps = RawAttention(model).attribute(ids, target=target, forward_kwargs={"attention_mask": mask})
    with torch.no_grad():
        eager = eager_maps(model, (ids,), {"attention_mask": mask})[-1].mean(1)
    row = target[0] if class_name.endswith("WithLMHeadModel") else target[1]
    torch.testing.assert_close(maps, eager[:, row] * mask, rtol=0, atol=1e-6)  # its softmax runs in float32


def test_mpt_padded_batch_under_the_identity_softmax_rule_is_refused():
    """MPT's ALiBi bias moves with the padding: the identity softmax rule (LRP, TransformerRelevance)
    would make a padded example's map depend on it, so such a batch is refused; one example alone,
    and the shift-invariant rules on the padded batch, run."""
    from captum_transformers import CaptureError, TransformerLRP
    model = build("mpt", "MptForCausalLM")
    ids, mask = batch()
    with pytest.raises(CaptureError, match="ALiBi"):
        TransformerLRP(model).attribute(ids, target=7, forward_kwargs={"attention_mask": mask})
    alone = TransformerLRP(model).attribute(ids[1:, :REAL], target=7, forward_kwargs={"attention_mask": mask[1:, :REAL]})
    assert torch.isfinite(alone).all() and alone.abs().sum() > 0
    maps = ConservativeLRP(model, "AH+LN").attribute(ids, target=7, forward_kwargs={"attention_mask": mask})
    assert torch.isfinite(maps).all()


def test_squeezebert_token_relevance_reads_its_channels_first_layers():
    """SqueezeBERT's layers take (B, D, N) hidden states: Gradient x Input is x * dy/dx at the
    first layer's input summed over the channels (a token per column), padding zero, and a padded
    batch equals the example alone."""
    from captum_transformers.methods.catalog import build_method
    model = build("squeezebert", "SqueezeBertForSequenceClassification")
    ids, mask = batch()
    entering = {}
    layer = model.transformer.encoder.layers[0]
    original = layer.forward

    def forward(hidden, *args, **kwargs):  # the encoder calls layer.forward itself: no hook sees it
        hidden.retain_grad()
        entering["x"] = hidden
        return original(hidden, *args, **kwargs)

    layer.forward = forward
    try:
        model(input_ids=ids, attention_mask=mask).logits[:, 1].sum().backward()
    finally:
        del layer.forward
    x = entering["x"]
    assert x.shape == (B, model.config.hidden_size, N)
    expected = (x.detach() * x.grad).sum(1) * mask
    model.zero_grad(set_to_none=True)
    method = build_method("gradient-x-input", model)
    maps = method.attribute(ids, target=1, forward_kwargs={"attention_mask": mask})
    torch.testing.assert_close(maps, expected, rtol=1e-10, atol=1e-14)
    alone = method.attribute(ids[1:, :REAL], target=1, forward_kwargs={"attention_mask": mask[1:, :REAL]})
    torch.testing.assert_close(maps[1, :REAL], alone[0], rtol=1e-8, atol=1e-12)


def _assert_padded_equals_single(method, model, ids, mask, target, tolerance=1e-10):
    scores = method.attribute(ids, target=target, forward_kwargs={"attention_mask": mask})
    alone = method.attribute(ids[1:, :REAL], target=target, forward_kwargs={"attention_mask": mask[1:, :REAL]})
    assert scores.shape == ids.shape and bool(torch.isfinite(scores).all())
    assert scores[1, REAL:].abs().max() == 0 and scores.abs().sum() > 0
    assert (scores[1:, :REAL] - alone).abs().max() <= tolerance * max(1.0, float(alone.abs().max()))
    return scores


@pytest.mark.parametrize("model_type,class_name,target", [
    ("xlnet", "XLNetForTokenClassification", (2, 1)), ("xlnet", "XLNetForQuestionAnsweringSimple", (0, 2)),
    ("bigbird_pegasus", "BigBirdPegasusForCausalLM", 7),
])
def test_xlnet_and_bigbird_pegasus_rules_apply_batch_equals_single_and_the_model_is_restored(model_type, class_name,
                                                                                              target):
    """XLNet (sequence-first hidden states: token relevance is read at its (N, B, D) first-layer input)
    and BigBird-Pegasus's decoder-only causal LM (its next-token score at the last real token): a padded
    batch gives each example's maps alone under GenericAttention, AttnLRP and ConservativeLRP AH+LN, the
    forward is bit-identical and the model restored (BigBird-Pegasus's is_causal flag included)."""
    from captum_transformers import AttnLRP
    model = build(model_type, class_name)
    ids, mask = batch(model.config.vocab_size)
    before = snapshot(model)
    flags = {name: m.is_causal for name, m in model.named_modules() if hasattr(m, "is_causal")}
    with torch.no_grad():
        plain = model(ids, attention_mask=mask)
    for method in (GenericAttention(model), AttnLRP(model), ConservativeLRP(model, "AH+LN")):
        _assert_padded_equals_single(method, model, ids, mask, target)
    assert_same(before, snapshot(model))
    assert flags == {name: m.is_causal for name, m in model.named_modules() if hasattr(m, "is_causal")}
    with torch.no_grad():
        again = model(ids, attention_mask=mask)
    field = "logits" if "logits" in plain else "start_logits"
    assert torch.equal(plain[field], again[field])


def test_xlnet_reads_its_padding_past_the_keys_each_query_keeps():
    """XLNet's content-stream mask leaves every query its own key, padding included: the key mask is
    read from the other queries (a padding key is seen by itself alone), and the padded query rows
    are the model's own (its maps equal eager output_attentions there too)."""
    model = build("xlnet", "XLNetForSequenceClassification")
    ids, mask = batch(model.config.vocab_size)
    recorder = captured(model, (ids,), {"attention_mask": mask})
    assert torch.equal(recorder.stream_mask("tokens"), mask.bool())
    first = recorder.sites[0].forward_value
    assert bool((first[1, :, REAL, REAL] > 0).all())  # a padding query sees its own key
    assert recorder.causal is False
    # attn_type="uni": XLNet's causal mask, read as causal (unpadded: transformers 5.x cannot add a
    # padding mask to it, a broadcast error of its own).
    uni = build("xlnet", "XLNetForSequenceClassification", attn_type="uni")
    assert captured(uni, (ids,), {}).causal is True


def test_xlnet_two_stream_and_memory_calls_are_refused_by_name():
    """The query stream (target_mapping: a second softmax over the content stream, for the permuted
    order's targets) and mems (keys over an earlier segment) are no maps over the input's tokens."""
    model = build("xlnet", "XLNetLMHeadModel")
    ids, mask = batch(model.config.vocab_size)
    target_mapping = torch.zeros(B, 1, N, dtype=torch.float64)
    target_mapping[:, 0, -1] = 1
    perm_mask = torch.zeros(B, N, N, dtype=torch.float64)
    perm_mask[:, :, -1] = 1
    with pytest.raises(UnsupportedModelError, match="two-stream"):
        captured(model, (ids,), {"attention_mask": mask, "perm_mask": perm_mask, "target_mapping": target_mapping})
    with torch.no_grad():
        mems = model(ids, attention_mask=mask, use_mems=True).mems
    with pytest.raises(UnsupportedModelError, match="mems"):
        captured(model, (ids,), {"mems": mems})


def test_bigbird_pegasus_causal_flag_follows_the_mask_the_decoder_gets():
    """The decoder self-attention is flagged causal only for the call whose mask blocks the later keys:
    a decoder given a full (B, 1, Q, K) mask of zeros stays non-causal, and cross-attention never is."""
    model = build("bigbird_pegasus", "BigBirdPegasusForCausalLM")
    ids, mask = batch(model.config.vocab_size)
    assert captured(model, (ids,), {"attention_mask": mask}).causal is True
    full = torch.zeros(B, 1, N, N, dtype=torch.float64)
    full[1, :, :, REAL:] = torch.finfo(torch.float64).min
    assert captured(model, (ids,), {"attention_mask": full}).causal is False


def test_xlnet_sequence_summary_is_explained_at_the_column_it_pools():
    """XLNet's classifier pools the last column (``summary_type="last"``, padding or not): raw
    attention is the eager head-mean row of that column, not row 0; a left-padded batch (XLNet's
    tokenizer side) equals the single calls; a right-padded row, whose pooled column is padding,
    is refused."""
    torch.manual_seed(0)
    config = transformers.XLNetConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, d_inner=64, pad_token_id=5,
                                      attn_implementation="eager")
    model = transformers.XLNetForSequenceClassification(config).double().eval()
    ids = torch.randint(6, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    ids[1, :3] = 5
    mask = (ids != 5).long()
    maps = RawAttention(model).attribute(ids, target=1, forward_kwargs={"attention_mask": mask})
    with torch.no_grad():
        eager = model(ids, attention_mask=mask, output_attentions=True).attentions[-1].mean(1)
    torch.testing.assert_close(maps, eager[:, -1] * mask, rtol=0, atol=1e-12)
    assert (maps - eager[:, 0] * mask).abs().max() > 1e-3
    for method in (GenericAttention(model), ConservativeLRP(model, "AH+LN")):
        batch = method.attribute(ids, target=1, forward_kwargs={"attention_mask": mask})
        single = method.attribute(ids[1:, 3:], target=1, forward_kwargs={"attention_mask": mask[1:, 3:]})
        torch.testing.assert_close(batch[1, 3:], single[0], rtol=1e-8, atol=1e-14)
    right = torch.cat([ids[1:, 3:], ids[1:, :3]], dim=1)
    with pytest.raises(InputError, match="padding"):
        RawAttention(model).attribute(right, target=1, forward_kwargs={"attention_mask": (right != 5).long()})
