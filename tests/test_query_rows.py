"""Models that do not read one token: the ``query_rows`` option of the HF adapter, and bare
encoders, whose features are no class scores.

A head that mean-pools a HF encoder is user code the adapter cannot see, so the explained
rows are the user's choice (``HuggingFaceAdapter(query_rows=...)``, as ``TorchMHAAdapter``);
a bare encoder with no target is refused with an error that names that option.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from captum_transformers import (ATTENTION_METHODS, LRP_ATTENTION_METHODS, GenericAttention, HuggingFaceAdapter,
                                 InputError, RawAttention)
from captum_transformers.adapters.torch_mha import TorchMHAAdapter
from hf_models import CASES, SMALL

transformers = pytest.importorskip("transformers")

ROW_METHODS = [pytest.param(m, id=m.__name__) for m in ATTENTION_METHODS + LRP_ATTENTION_METHODS]


class MeanPoolingClassifier(nn.Module):
    """A sentence encoder's use of BERT: the real tokens' mean, then a linear head."""

    def __init__(self):
        super().__init__()
        self.encoder = transformers.BertModel(transformers.BertConfig(**SMALL, vocab_size=99,
                                                                      attn_implementation="eager"))
        self.head = nn.Linear(SMALL["hidden_size"], 3)

    def forward(self, input_ids, attention_mask):
        hidden = self.encoder(input_ids, attention_mask=attention_mask).last_hidden_state
        weights = attention_mask[:, :, None].to(hidden.dtype)
        return self.head((hidden * weights).sum(1) / weights.sum(1))


def _pooled():
    torch.manual_seed(0)
    return MeanPoolingClassifier().eval()


def _bert_inputs(lengths=(7, 5, 3)):
    ids, _ = CASES["bert"].inputs(batch=len(lengths))
    mask = torch.zeros(len(lengths), 7, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    return ids, {"attention_mask": mask}


def _layout(model, option, kwargs, ids, target=0):
    # RawAttention takes no gradient: the default row of the pooling head is not checked.
    return RawAttention(model, adapter=HuggingFaceAdapter(query_rows=option)).trace(
        ids, target=target, forward_kwargs=kwargs).layout


def test_query_rows_choose_the_explained_rows():
    model, (ids, kwargs) = _pooled(), _bert_inputs()
    assert _layout(model, None, kwargs, ids).query_rows.tolist() == [[0]] * 3
    assert _layout(model, "last", kwargs, ids).query_rows.tolist() == [[6], [4], [2]]
    assert _layout(model, 2, kwargs, ids).query_rows.tolist() == [[2]] * 3
    assert _layout(model, -1, kwargs, ids).query_rows.tolist() == [[6]] * 3
    mean = _layout(model, "mean", kwargs, ids)
    assert mean.query_rows.tolist() == [list(range(7))] * 3
    for weights, length in zip(mean.query_weights, (7, 5, 3)):
        torch.testing.assert_close(weights, torch.tensor([1 / length] * length + [0.0] * (7 - length)))


@pytest.mark.parametrize("option", ["first", True, 1.0, "MEAN"])
def test_invalid_query_rows_are_refused(option):
    for adapter in (HuggingFaceAdapter, TorchMHAAdapter):
        with pytest.raises(InputError, match="query_rows must be"):
            adapter(query_rows=option)


def test_query_row_outside_the_sequence_is_refused():
    model, (ids, kwargs) = _pooled(), _bert_inputs()
    with pytest.raises(InputError, match=r"query_rows=7 is outside the 7 tokens"):
        _layout(model, 7, kwargs, ids)


def test_mean_rows_of_the_last_map_equal_the_models_attention():
    """RawAttention with query_rows='mean' is the last map's head mean averaged over real rows."""
    model, (ids, kwargs) = _pooled(), _bert_inputs()
    scores = RawAttention(model, adapter=HuggingFaceAdapter(query_rows="mean")).attribute(
        ids, target=1, forward_kwargs=kwargs, return_tokens=True)
    with torch.no_grad():
        last = model.encoder(ids, output_attentions=True, **kwargs).attentions[-1].mean(1)
    mask = kwargs["attention_mask"].to(last.dtype)
    expected = (last * mask[:, :, None]).sum(1) / mask.sum(1, keepdim=True) * mask
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ROW_METHODS)
def test_mean_rows_batch_equals_single_with_padding(method):
    model, (ids, kwargs) = _pooled(), _bert_inputs()
    explainer = method(model, adapter=HuggingFaceAdapter(query_rows="mean"))
    targets = [0, 2, 1]
    batched = explainer.attribute(ids, target=targets, forward_kwargs=kwargs, return_tokens=True)
    assert (batched[1, 5:] == 0).all() and (batched[2, 3:] == 0).all()
    for i, length in enumerate((7, 5, 3)):
        single = explainer.attribute(ids[i:i + 1, :length], target=targets[i], return_tokens=True,
                                     forward_kwargs={"attention_mask": kwargs["attention_mask"][i:i + 1, :length]})
        torch.testing.assert_close(batched[i:i + 1, :length], single, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("method", ROW_METHODS)
def test_a_hidden_pooling_head_is_refused_where_the_gradient_shows_it(method):
    """The gradient at the last attention output shows which rows the score reads: methods that
    take it refuse the default CLS row of a mean-pooling head and name query_rows. Forward-only
    methods cannot know (documented limit): they explain the default row."""
    model, (ids, kwargs) = _pooled(), _bert_inputs()
    explainer = method(model)
    if not explainer.capture_spec().needs_gradient:
        scores = explainer.attribute(ids, target=1, forward_kwargs=kwargs, return_tokens=True)
        assert torch.isfinite(scores).all()
        return
    with pytest.raises(InputError, match=r"depends on the last layer's tokens \[0, 1, 2, 3, 4, 5, 6\], but the "
                                         r"explanation reads the row\(s\) \[0\] only") as error:
        explainer.attribute(ids, target=1, forward_kwargs=kwargs, return_tokens=True)
    assert "HuggingFaceAdapter(query_rows='mean')" in str(error.value)


def test_a_token_level_target_read_at_another_row_is_refused():
    """A masked-LM score at position 3 reads row 3. HF's token-level heads are read there by
    default (tests/test_token_level_heads.py); a user's module around one, which the adapter
    cannot name, is refused by the gradient check instead of explained at the CLS row."""
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(transformers.BertConfig(**SMALL, vocab_size=99)).eval()
    ids, kwargs = _bert_inputs(lengths=(7, 5, 4))
    chosen = GenericAttention(model, adapter=HuggingFaceAdapter(query_rows=3)).attribute(
        ids, target=(3, 5), forward_kwargs=kwargs, return_tokens=True)
    assert torch.isfinite(chosen).all() and (chosen[:, 3] != 0).all()
    default = GenericAttention(model).attribute(ids, target=(3, 5), forward_kwargs=kwargs, return_tokens=True)
    torch.testing.assert_close(default, chosen, rtol=0, atol=0)

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, input_ids, attention_mask=None):
            return self.inner(input_ids, attention_mask=attention_mask).logits

    with pytest.raises(InputError, match=r"depends on the last layer's tokens \[3\]"):
        GenericAttention(Wrapped(), adapter=HuggingFaceAdapter()).attribute(ids, target=(3, 5), forward_kwargs=kwargs)


@pytest.mark.parametrize("case", ["bert_model", "clip_vision", "clip_text"])
def test_bare_encoder_without_target_is_refused(case):
    if case == "bert_model":
        torch.manual_seed(0)
        model = transformers.BertModel(transformers.BertConfig(**SMALL, vocab_size=99)).eval()
        inputs, kwargs = _bert_inputs()
    else:
        model, (inputs, kwargs) = CASES[case].model(), CASES[case].inputs()
    for method in ATTENTION_METHODS + LRP_ATTENTION_METHODS:
        with pytest.raises(InputError, match="not class scores") as error:
            method(model).attribute(inputs, forward_kwargs=kwargs)
        for hint in ("target=", "query_rows=", "Wrap the encoder"):
            assert hint in str(error.value)
    # A target names the feature to explain: accepted.
    assert torch.isfinite(GenericAttention(model).attribute(inputs, target=2, forward_kwargs=kwargs)).all()


def test_query_rows_on_a_model_with_several_streams_is_refused():
    torch.manual_seed(0)
    bart = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=99, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32)).eval()
    source, prefix = torch.randint(3, 99, (2, 6)), torch.randint(3, 99, (2, 3))
    with pytest.raises(InputError, match="query_rows='mean' chooses the explained rows of one token sequence"):
        GenericAttention(bart, adapter=HuggingFaceAdapter(query_rows="mean")).attribute((source, prefix), target=4)


def test_mean_rows_of_a_per_position_output_are_refused():
    """A causal LM's next-token scores are read at one position: a mean over rows is no output."""
    spec = CASES["gpt2"]
    model = spec.model()
    ids, kwargs = spec.inputs()
    with pytest.raises(InputError, match="one score vector per position"):
        GenericAttention(model, adapter=HuggingFaceAdapter(query_rows="mean")).attribute(ids, target=3,
                                                                                      forward_kwargs=kwargs)
    last = GenericAttention(model, adapter=HuggingFaceAdapter(query_rows="last")).attribute(
        ids, target=3, forward_kwargs=kwargs, return_tokens=True)
    torch.testing.assert_close(last, GenericAttention(model).attribute(ids, target=3, forward_kwargs=kwargs,
                                                                         return_tokens=True))


class _MeanPoolingEncoder(nn.Module):
    """nn.TransformerEncoder + a mean over the real tokens + a linear head."""

    def __init__(self, batch_first):
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Embedding(20, 16)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0,
                                                                        batch_first=batch_first), 2)
        self.head = nn.Linear(16, 3)

    def forward(self, ids, key_padding_mask):
        x = self.embed(ids) if self.batch_first else self.embed(ids).transpose(0, 1)
        hidden = self.encoder(x, src_key_padding_mask=key_padding_mask)
        hidden = hidden if self.batch_first else hidden.transpose(0, 1)
        real = (~key_padding_mask)[:, :, None].to(hidden.dtype)
        return self.head((hidden * real).sum(1) / real.sum(1))


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "sequence_first"])
def test_a_hidden_pooling_head_of_an_mha_model_is_refused(batch_first):
    torch.manual_seed(0)
    model = _MeanPoolingEncoder(batch_first).eval()
    ids = torch.randint(0, 20, (3, 3))  # B == N: the orientation must come from the module
    padding = torch.tensor([[False, False, False], [False, False, True], [False, False, False]])
    with pytest.raises(InputError, match=r"TorchMHAAdapter\(query_rows='mean'\)"):
        GenericAttention(model).attribute(ids, target=1, additional_forward_args=(padding,))
    scores = GenericAttention(model, adapter=TorchMHAAdapter("mean")).attribute(
        ids, target=1, additional_forward_args=(padding,), return_tokens=True)
    assert torch.isfinite(scores).all() and scores[1, 2] == 0


def test_detr_takes_no_query_rows():
    """DETR's explained row is the target's object query: the option would be ignored, so it is absent."""
    from captum_transformers.adapters.huggingface.detr import DetrAdapter

    with pytest.raises(TypeError):
        DetrAdapter(query_rows="mean")
