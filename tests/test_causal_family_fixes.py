"""Families of the coverage harness whose cells were refused for the package's own reasons.

* DeepSeek-V4: its compressed-attention layers append compressed KV entries (summaries of token
  windows) to the keys; refused by name where they appear, explained where the sequence is shorter
  than the compress rate (no entries).
* LongCat-Flash: two attention sublayers per decoder layer (``self_attn.0``, ``self_attn.1``,
  class ``LongcatFlashMLA``): the relevance methods find the decoder layer as the first layer.
* EuroBERT's sequence classifier pools as ``config.classifier_pooling`` says (bos / mean / late).
* Inkling mixes positions with short convolutions outside its attention maps: the methods reading
  the last layer's rows are refused by name.
* Gemma 3n's Captum baselines: the model's backward holds NaN at the all-zero [PAD] embedding (the
  AltUp magnitude's square root at 0); a padded position's score is set to 0, not multiplied.

Tiny float64 models built from configs (benchmarks/coverage/shrink.py). The end-to-end tests of
LongCat, EuroBERT, DeepSeek-V4's refusal and saliency, and Gemma 3n need the HuggingFace adapter /
Captum baseline changes of /tmp/families_*.patch.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.coverage.shrink import build_model, small_config  # noqa: E402

from captum_transformers import (GenericAttention, HuggingFaceAdapter, InputError, RawAttention,  # noqa: E402
                                 UnsupportedModelError)
from captum_transformers.adapters.model_parts import enclosing_layer  # noqa: E402
from captum_transformers.adapters.query_rows import config_pooled_rows  # noqa: E402
from captum_transformers.capture.trace import Block  # noqa: E402
from captum_transformers.methods.catalog import build_method  # noqa: E402

IDS = torch.tensor([[5, 9, 12, 7, 30, 11], [6, 8, 14, 21, 0, 0]])
MASK = (IDS != 0).long()


def _model(model_type: str, class_name: str, head: str, **settings):
    config = small_config(model_type, class_name, head)
    for key, value in settings.items():
        setattr(config, key, value)
    return build_model(config, class_name)


# -- DeepSeek-V4 ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def deepseek_v4():
    # Layer 0 heavily compressed (rate 128), layer 1 compressed sparse (rate 4).
    return _model("deepseek_v4", "DeepseekV4ForCausalLM", "causal-lm")


def test_deepseek_v4_compressed_keys_refused_by_name(deepseek_v4):
    ids = torch.tensor([[5, 9, 12, 7, 30, 11, 40, 17]])  # two windows of 4: two compressed entries in layer 1
    with pytest.raises(UnsupportedModelError, match=r"attends over 10 keys for 8 tokens: 2 of them are compressed KV"):
        RawAttention(deepseek_v4).attribute(ids, target=7)


def test_deepseek_v4_saliency_at_the_last_token_despite_the_refusal(deepseek_v4):
    # The attention methods refuse the model; the gradient baselines still read its next-token
    # logits at each row's last real token (it is causal by construction).
    ids = torch.tensor([[5, 9, 12, 7, 30, 11, 40, 17], [6, 8, 14, 21, 3, 0, 0, 0]])
    mask = (ids != 0).long()
    scores = build_method("saliency", deepseek_v4).attribute(ids, target=7, forward_kwargs={"attention_mask": mask})
    single = build_method("saliency", deepseek_v4).attribute(ids[1:, :5], target=7)
    assert torch.isfinite(scores).all() and not scores[mask == 0].any()
    torch.testing.assert_close(scores[1, :5], single[0], rtol=1e-8, atol=1e-12)


def test_deepseek_v4_shorter_than_the_compress_rate_is_its_eager_map(deepseek_v4):
    ids = torch.tensor([[5, 9, 12]])  # no window closes: no compressed entry, sinks only
    maps = RawAttention(deepseek_v4).attribute(ids, target=7)
    with torch.no_grad():
        eager = deepseek_v4(input_ids=ids, output_attentions=True).attentions[-1].mean(1)[:, -1]
    torch.testing.assert_close(maps, eager, rtol=0, atol=1e-10)


# -- LongCat-Flash ---------------------------------------------------------------------
def test_enclosing_layer_of_an_attention_list_inside_a_layer():
    layer = torch.nn.Module()
    layer.self_attn = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([layer])
    inner = Block("layers.0.self_attn.0", layer.self_attn[0], "self")
    assert enclosing_layer(model, inner) is layer
    # A list of attention modules with no numbered ancestor: the block is its own layer, as before.
    assert enclosing_layer(layer, Block("self_attn.1", layer.self_attn[1], "self")) is layer.self_attn[1]
    assert enclosing_layer(model, Block("layers.0", layer, "self")) is layer


def test_longcat_flash_gradient_x_input_at_the_first_decoder_layer():
    model = _model("longcat_flash", "LongcatFlashForCausalLM", "causal-lm")
    ids = IDS[:1]
    scores = build_method("gradient-x-input", model).attribute(ids, target=7)
    kept = {}

    def keep(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        hidden.retain_grad()
        kept["hidden"] = hidden

    handle = model.model.layers[0].register_forward_pre_hook(keep, with_kwargs=True)
    try:
        logits = model(input_ids=ids).logits
    finally:
        handle.remove()
    logits[0, -1, 7].backward()
    expected = (kept["hidden"] * kept["hidden"].grad).sum(-1).detach()
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-8)  # its router runs in float32


# -- EuroBERT --------------------------------------------------------------------------
def test_config_pooled_rows_rows_of_data():
    config = transformers.EuroBertConfig(classifier_pooling="bos")
    assert config_pooled_rows("eurobert", "EuroBertForSequenceClassification", config) == 0
    config.classifier_pooling = "late"
    assert config_pooled_rows("eurobert", "EuroBertForSequenceClassification", config) == "mean"
    assert config_pooled_rows("eurobert", "EuroBertForTokenClassification", config) is None
    assert config_pooled_rows("bert", "BertForSequenceClassification", config) is None
    config.classifier_pooling = "max"
    with pytest.raises(InputError, match="classifier_pooling='max'"):
        config_pooled_rows("eurobert", "EuroBertForSequenceClassification", config)


@pytest.mark.parametrize("pooling, rows", [("late", "mean"), ("mean", "mean"), ("bos", 0)])
def test_eurobert_classifier_explained_at_its_pooled_rows(pooling, rows):
    model = _model("eurobert", "EuroBertForSequenceClassification", "sequence-classification",
                   classifier_pooling=pooling)
    kwargs = {"target": 1, "forward_kwargs": {"attention_mask": MASK}}
    default = GenericAttention(model).attribute(IDS, **kwargs)  # was refused: the score reads every row
    chosen = GenericAttention(model, adapter=HuggingFaceAdapter(query_rows=rows)).attribute(IDS, **kwargs)
    torch.testing.assert_close(default, chosen, rtol=0, atol=0)


# -- Inkling ---------------------------------------------------------------------------
def test_inkling_row_methods_refused_naming_its_convolutions():
    model = _model("inkling_text", "InklingForCausalLM", "causal-lm")
    with pytest.raises(UnsupportedModelError, match="Inkling mixes positions outside its attention maps"):
        GenericAttention(model).attribute(IDS, target=7, forward_kwargs={"attention_mask": MASK})


# -- Gemma 3n --------------------------------------------------------------------------
def test_gemma3n_saliency_finite_with_zero_pad_embedding():
    model = _model("gemma3n_text", "Gemma3nForCausalLM", "causal-lm")
    assert model.config.pad_token_id == 0 and not model.model.embed_tokens.weight[0].any()  # [PAD] embeds to 0
    scores = build_method("saliency", model).attribute(IDS, target=7, forward_kwargs={"attention_mask": MASK})
    assert torch.isfinite(scores).all()
    assert not scores[MASK == 0].any()
    single = build_method("saliency", model).attribute(IDS[1:, :4], target=7)
    torch.testing.assert_close(scores[1, :4], single[0], rtol=1e-8, atol=1e-12)
