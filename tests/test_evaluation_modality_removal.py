"""compact_tokens and ModalityTokenRemoval on a two-modality toy model that sums token values."""
import pytest
import torch

from captum_transformers.errors import InputError
from captum_transformers.evaluation import ModalityTokenRemoval, compact_tokens
from captum_transformers.evaluation.tokens.modality_removal import kept_counts


def test_compact_tokens_left_packs_in_order_and_repads():
    values = torch.arange(2 * 5 * 2).reshape(2, 5, 2).float()
    keep = torch.tensor([[False, True, False, True, True], [True, False, False, False, False]])
    packed, mask = compact_tokens(values, keep, pad_value=-1.0)
    assert packed.shape == (2, 3, 2)
    assert packed[0].tolist() == values[0, [1, 3, 4]].tolist()
    assert packed[1].tolist() == [values[1, 0].tolist(), [-1.0, -1.0], [-1.0, -1.0]]
    assert mask.tolist() == [[True, True, True], [True, False, False]]
    empty, empty_mask = compact_tokens(values, torch.zeros(2, 5, dtype=torch.bool))
    assert empty.shape == (2, 0, 2) and empty_mask.shape == (2, 0)


def test_compact_tokens_rejects_mismatched_keep():
    with pytest.raises(InputError, match="keep"):
        compact_tokens(torch.zeros(2, 5), torch.ones(2, 4, dtype=torch.bool))


def test_kept_counts_floor_without_float_noise():
    counts = kept_counts((0.0, 0.25, 0.5, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0), torch.ones(1, 10, dtype=torch.bool))
    assert counts[:, 0].tolist() == [10, 7, 5, 2, 2, 1, 1, 0, 0]


class SumModel:
    """Class 1 iff the summed image-token values exceed the summed text-token values; checks its input."""

    def __init__(self):
        self.calls, self.lengths = 0, []

    def __call__(self, inputs):
        self.calls += 1
        image, image_mask = inputs["image"]
        text, text_mask = inputs["text"]
        self.lengths.append(image.shape[1])
        assert (image[~image_mask] == 0).all()  # re-padded with pad_value
        evidence = (image[..., 0] * image_mask).sum(dim=1) - (text * text_mask).sum(dim=1)
        return torch.stack([torch.zeros_like(evidence), evidence], dim=1)


def make_batch(n=8, tokens=12, seed=0):
    generator = torch.Generator().manual_seed(seed)
    image = torch.rand(n, tokens, 3, generator=generator, dtype=torch.float64)
    image[:, :, 0] = torch.rand(n, tokens, generator=generator, dtype=torch.float64) ** 4  # a few strong tokens
    image_mask = torch.ones(n, tokens, dtype=torch.bool)
    image_mask[: n // 2, -3:] = False
    image[~image_mask] = 0.0
    text = torch.full((n, 4), 0.3, dtype=torch.float64)
    inputs = {"image": (image, image_mask), "text": (text, torch.ones(n, 4, dtype=torch.bool))}
    relevance = {"perfect": image[..., 0], "random": torch.rand(n, tokens, generator=generator),
                 "reversed": -image[..., 0]}
    return inputs, relevance, torch.ones(n, dtype=torch.long)


def curve(name, mode, **options):
    inputs, relevance, labels = make_batch()
    metric = ModalityTokenRemoval(SumModel(), modality="image", mode=mode, **options)
    metric.update(inputs, relevance[name], labels)
    return metric.compute()


def test_positive_and_negative_orderings():
    positive = {k: curve(k, "positive") for k in ("perfect", "random", "reversed")}
    negative = {k: curve(k, "negative") for k in ("perfect", "random", "reversed")}
    assert positive["perfect"].auc < positive["random"].auc < positive["reversed"].auc
    assert negative["perfect"].auc > negative["random"].auc > negative["reversed"].auc
    assert positive["perfect"].y[-1] == 0.0  # no image token left: 0 - 1.2 < 0


def test_known_accuracy_and_one_stacked_call():
    inputs, relevance, labels = make_batch()
    model = SumModel()
    metric = ModalityTokenRemoval(model, modality="image", mode="negative", fractions=(0.0, 0.5))
    metric.update(inputs, relevance["perfect"], labels)
    image, image_mask = inputs["image"]
    kept_half = torch.sort(torch.where(image_mask, image[..., 0], -1.0), dim=1, descending=True).values
    n = image_mask.sum(dim=1)
    expected_half = [float(kept_half[b, : int(n[b]) // 2].sum() > 1.2) for b in range(len(n))]
    expected_full = (image[..., 0].sum(dim=1) > 1.2).double().mean().item()
    assert metric.compute().y == pytest.approx((expected_full, sum(expected_half) / len(n)))
    assert model.calls == 1 and model.lengths == [12]


def test_special_tokens_are_kept_and_soft_labels_score_the_answer():
    inputs, relevance, _ = make_batch(n=2)
    special = torch.zeros(2, 12, dtype=torch.bool)
    special[:, 0] = True
    soft = torch.tensor([[0.0, 0.6], [0.3, 1.0]])
    seen = []

    def forward(batch):
        seen.append(batch["image"])
        return SumModel()(batch)

    metric = ModalityTokenRemoval(forward, modality="image", mode="positive", fractions=(0.0, 1.0))
    metric.update(inputs, relevance["random"], soft, special_tokens_mask=special)
    packed, packed_mask = seen[0]
    assert packed_mask[2:].sum(dim=1).tolist() == [1, 1]  # at f = 1 only the special token remains
    assert torch.equal(packed[2:, 0], inputs["image"][0][:, 0])
    result = metric.compute()
    predicted_full = (inputs["image"][0][..., 0].sum(dim=1) > 1.2).long()
    assert result.y[0] == pytest.approx(soft[torch.arange(2), predicted_full].mean().item())


def test_two_updates_equal_one_update_and_max_batch_size_gives_the_same_state():
    inputs, relevance, labels = make_batch()
    whole = ModalityTokenRemoval(SumModel(), "image")
    whole.update(inputs, relevance["random"], labels)
    split = ModalityTokenRemoval(SumModel(), "image")
    for part in (slice(0, 3), slice(3, 8)):
        split.update({k: (v[part], m[part]) for k, (v, m) in inputs.items()}, relevance["random"][part], labels[part])
    assert all(torch.equal(whole.state()[k], split.state()[k]) for k in whole.state())
    model = SumModel()
    bounded = ModalityTokenRemoval(model, "image", max_batch_size=16)
    bounded.update(inputs, relevance["random"], labels)
    assert model.calls == 5 and torch.equal(bounded.state()["sums"], whole.state()["sums"])


def test_bad_inputs_raise_input_error():
    inputs, relevance, labels = make_batch()
    metric = ModalityTokenRemoval(SumModel(), "image")
    with pytest.raises(InputError, match="'image'"):
        metric.update({"text": inputs["text"]}, relevance["random"], labels)
    with pytest.raises(InputError, match="pair"):
        metric.update({**inputs, "text": inputs["text"][0]}, relevance["random"], labels)
    with pytest.raises(InputError, match="share"):
        metric.update(inputs, relevance["random"][:, :5], labels)
    with pytest.raises(InputError, match="labels"):
        metric.update(inputs, relevance["random"], labels.double())
    with pytest.raises(InputError, match="mode"):
        ModalityTokenRemoval(SumModel(), "image", mode="up")


def test_end_to_end_on_lxmert_with_generic_attention_region_scores():
    """The bi-modal loop a user writes: per-stream token scores of an LXMERT explanation drive
    the removal of image regions, and the clean step reproduces the model's own accuracy."""
    pytest.importorskip("transformers")
    from captum_transformers import GenericAttention
    from inline_models import lxmert, regions, text

    model = lxmert()
    ids, text_mask = text()
    feats, pos = regions()
    labels = model(ids, feats, pos, attention_mask=text_mask).question_answering_score.argmax(-1)
    _, region_scores = GenericAttention(model).attribute(
        (ids, feats, pos), target=labels.tolist(), forward_kwargs={"attention_mask": text_mask}, return_tokens=True)

    def forward(modalities):
        (text_ids, mask), (boxes, box_mask) = modalities["text"], modalities["image"]
        return model(text_ids, boxes[..., :feats.shape[-1]], boxes[..., feats.shape[-1]:], attention_mask=mask,
                     visual_attention_mask=box_mask).question_answering_score

    image = torch.cat([feats, pos], dim=-1)
    image_mask = torch.ones(image.shape[:2], dtype=torch.bool)
    metric = ModalityTokenRemoval(forward, modality="image", fractions=(0.0, 0.5, 0.75))
    with torch.no_grad():
        metric.update({"text": (ids, text_mask), "image": (image, image_mask)}, region_scores, labels)
    result = metric.compute()
    assert result.y[0] == 1.0  # nothing removed: the model's own predictions
    # Half removed, by hand: keep the two least relevant regions of each example, in order.
    kept = region_scores.argsort(dim=1, descending=True, stable=True)[:, 2:].sort(dim=1).values
    index = kept[..., None].expand(-1, -1, image.shape[-1])
    with torch.no_grad():
        half = forward({"text": (ids, text_mask),
                        "image": (image.gather(1, index), torch.ones(kept.shape, dtype=torch.bool))})
    assert result.y[1] == pytest.approx((half.argmax(-1) == labels).double().mean().item())
