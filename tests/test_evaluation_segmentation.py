"""SegmentationScores and the vectorised average precision, against known answers and scikit-learn."""
import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score

from captum_transformers.errors import InputError
from captum_transformers.evaluation import SegmentationScores, average_precision


def masks_and_maps(n=6, size=10, seed=0):
    generator = torch.Generator().manual_seed(seed)
    masks = torch.zeros(n, size, size, dtype=torch.bool)
    for i in range(n):  # a different rectangle per image
        masks[i, i % 3: 4 + i % 5, 1 + i % 4: 7] = True
    random = torch.rand(n, size, size, generator=generator)
    return masks, {"perfect": masks.double(), "reversed": 1.0 - masks.double(), "random": random}


def scores(maps, masks):
    metric = SegmentationScores()
    metric.update(maps, masks)
    return metric.compute()


def sklearn_mean_ap(maps, masks):
    aps = []
    for m, g in zip(maps.double(), masks):
        m = (m - m.min()) / (m.max() - m.min())
        s = torch.stack([1 - m, m]).numpy().ravel()
        y = torch.stack([~g, g]).numpy().ravel()
        aps.append(average_precision_score(y, s))
    return float(np.mean(aps))


def test_perfect_reversed_random():
    masks, maps = masks_and_maps()
    perfect, reversed_, random = (scores(maps[k], masks) for k in ("perfect", "reversed", "random"))
    assert perfect.miou == pytest.approx(1.0, abs=1e-12) and perfect.pixel_accuracy == 1.0
    assert perfect.mean_ap == pytest.approx(1.0, abs=1e-9)
    assert reversed_.miou == 0.0 and reversed_.pixel_accuracy == 0.0
    assert 0.0 < random.miou < 1.0 and 0.0 < random.pixel_accuracy < 1.0
    assert reversed_.mean_ap < random.mean_ap < perfect.mean_ap


def test_dataset_counts_and_ap_match_a_direct_computation():
    masks, maps = masks_and_maps()
    result = scores(maps["random"], masks)
    normalized = maps["random"] - maps["random"].amin(dim=(1, 2), keepdim=True)
    normalized = normalized / normalized.amax(dim=(1, 2), keepdim=True)
    predicted = normalized > normalized.mean(dim=(1, 2), keepdim=True)
    inter_fg, union_fg = (predicted & masks).sum().item(), (predicted | masks).sum().item()
    inter_bg, union_bg = (~predicted & ~masks).sum().item(), (~predicted | ~masks).sum().item()
    assert result.iou_foreground == pytest.approx(inter_fg / union_fg, rel=1e-12)
    assert result.miou == pytest.approx((inter_fg / union_fg + inter_bg / union_bg) / 2, rel=1e-12)
    assert result.pixel_accuracy == (predicted == masks).double().mean().item()
    assert result.mean_ap == pytest.approx(sklearn_mean_ap(maps["random"], masks), abs=1e-9)


@pytest.mark.parametrize("levels", [None, 3, 2])
def test_average_precision_equals_sklearn_with_and_without_ties(levels):
    generator = torch.Generator().manual_seed(1)
    scores_ = torch.rand(40, 25, generator=generator, dtype=torch.float64)
    if levels is not None:  # few distinct values: many ties
        scores_ = torch.floor(scores_ * levels) / levels
    labels = torch.rand(40, 25, generator=generator) > 0.6
    labels[:, 0] = True
    ours = average_precision(scores_, labels)
    reference = torch.tensor([average_precision_score(l.numpy(), s.numpy()) for s, l in zip(scores_, labels)],
                             dtype=torch.float64)
    assert torch.allclose(ours, reference, rtol=0, atol=1e-12)


def test_average_precision_without_positives_is_nan():
    assert torch.isnan(average_precision(torch.rand(1, 4), torch.zeros(1, 4))).all()


def test_constant_map_predicts_no_foreground():
    masks, _ = masks_and_maps(n=2)
    result = scores(torch.full((2, 10, 10), 3.0), masks)
    assert result.iou_foreground == 0.0
    assert result.pixel_accuracy == (~masks).double().mean().item()


def test_two_updates_equal_one_update_on_the_concatenation():
    masks, maps = masks_and_maps()
    whole, split = SegmentationScores(), SegmentationScores()
    whole.update(maps["random"], masks)
    split.update(maps["random"][:2], masks[:2])
    split.update(maps["random"][2:], masks[2:])
    assert all(torch.equal(whole.state()[k], split.state()[k]) for k in whole.state())
    assert whole.compute() == split.compute()


def test_bad_inputs_raise_input_error():
    masks, maps = masks_and_maps()
    with pytest.raises(InputError, match="shape"):
        SegmentationScores().update(maps["random"][:, :5], masks)
    with pytest.raises(InputError, match="dims"):
        SegmentationScores().update(maps["random"][0], masks[0])
    with pytest.raises(InputError, match="torch.Tensor"):
        SegmentationScores().update(maps["random"].numpy(), masks)
