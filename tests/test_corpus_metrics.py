"""Metrics computed from a corpus store (captum_transformers.corpus.evaluate_store) equal the
same metrics fed the live maps, bit for bit; over two ranks equal to one; wrong data, an
unfinished store and a generation store are refused."""
import json

import pytest
import torch

pytest.importorskip("pyarrow")

from captum_transformers.corpus import digit_canvas_source, evaluate_store, explain_dataset, table_source
from captum_transformers.corpus.store import record_path
from captum_transformers.errors import InputError
from captum_transformers.evaluation import Comprehensiveness, PixelFlipping, RiseDeletion
from captum_transformers.methods.catalog import build_method
from captum_transformers.tasks.digits.model import load_digit_model


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    model = load_digit_model().eval()
    out = tmp_path_factory.mktemp("store")
    source = digit_canvas_source(24)
    explain_dataset(model, source, "generic-attention", out, batch_size=8, shard_rows=8, progress=False)
    return model, source, out


def _image_metrics(model):
    size = tuple(digit_canvas_source(1).batch(0, 1)[0][0].shape[-2:])
    return [RiseDeletion(model, fractions=(0.0, 0.25, 0.5, 1.0)), PixelFlipping(model, size, features_in_step=64)]


def test_image_metrics_from_the_store_equal_the_live_maps_bit_for_bit(digits):
    model, source, out = digits
    from_store = evaluate_store(out, source, _image_metrics(model))
    live = _image_metrics(model)
    method = build_method("generic-attention", model)
    for low in range(0, 24, 8):
        images = source.batch(low, low + 8)[0][0]
        with torch.no_grad():
            target = model(images).argmax(-1)
        maps = method.attribute(images, target=target).float()
        for metric in live:
            metric.update(images, target, maps)
    for stored, fresh in zip(from_store, [metric.compute() for metric in live]):
        assert stored == fresh


def test_two_ranks_summed_equal_one(digits):
    model, source, out = digits
    halves = [_image_metrics(model) for _ in range(2)]
    for rank, metrics in enumerate(halves):
        evaluate_store(out, source, metrics, rank=rank, world_size=2)
    merged = [a.merge(b) for a, b in zip(*halves)]
    assert [metric.compute() for metric in merged] == evaluate_store(out, source, _image_metrics(model))


def test_other_data_an_unfinished_store_and_no_metrics_are_refused(digits, tmp_path):
    model, source, out = digits
    with pytest.raises(InputError, match=r"explains 24 rows of 'digit-canvases:test:one:n=24:seed=0'.*pass the data"):
        evaluate_store(out, digit_canvas_source(24, seed=1), _image_metrics(model))
    with pytest.raises(InputError, match="non-empty list of the package's metrics"):
        evaluate_store(out, source, [])
    explain_dataset(model, source, "generic-attention", tmp_path, batch_size=8, shard_rows=8, progress=False)
    record_path(tmp_path, 2).unlink()
    with pytest.raises(InputError, match=r"not finished: shards \[2\]"):
        evaluate_store(tmp_path, source, _image_metrics(model))


def test_token_metrics_read_the_unpadded_maps_back_into_padded_rows(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        num_labels=3, attn_implementation="eager")).eval()
    texts = ["a b c", "b c d e f", "c a", "d e", "e f a b", "f f c"]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    vocab = {w: i + 5 for i, w in enumerate("abcdef")}

    def prepare(values):
        tokens = [v.split() for v in values]
        width = max(map(len, tokens))
        ids = torch.tensor([[vocab[w] for w in t] + [0] * (width - len(t)) for t in tokens])
        mask = (torch.arange(width)[None] < torch.tensor([len(t) for t in tokens])[:, None]).long()
        return (ids,), {"attention_mask": mask}, tokens

    source = table_source(tmp_path / "rows.jsonl", prepare)
    explain_dataset(model, source, "attn-lrp", tmp_path / "out", batch_size=4, shard_rows=4, progress=False)

    def forward(inputs):
        return model(**inputs).logits

    (stored,) = evaluate_store(tmp_path / "out", source, [Comprehensiveness(forward, fractions=(0.5,))])
    live = Comprehensiveness(forward, fractions=(0.5,))
    method = build_method("attn-lrp", model)
    for low in range(0, 6, 4):
        (ids,), kwargs, _ = prepare(texts[low:low + 4])
        with torch.no_grad():
            target = model(ids, **kwargs).logits.argmax(-1)
        relevance = method.attribute(ids, target=target, forward_kwargs=kwargs, return_tokens=True).float()
        live.update(ids, kwargs["attention_mask"], relevance * kwargs["attention_mask"], target)
    assert stored == live.compute()
