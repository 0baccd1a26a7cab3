"""RISE deletion and insertion (Petsiuk et al., BMVC 2018) on a linear toy model whose scores are known by hand."""
import math

import pytest
import torch

from captum_transformers.errors import InputError
from captum_transformers.evaluation.images.deletion_insertion import RISE_FRACTIONS, RiseDeletion, RiseInsertion
from captum_transformers.evaluation.images.occlusion import gaussian_blur

HALVES = (0.0, 0.5, 1.0)
WEIGHTS = torch.tensor([4.0, 3.0, 2.0, 1.0], dtype=torch.float64)


def linear_model(images):
    """logits = [0, channel-summed pixels of the 2 x 2 top-left corner weighted by WEIGHTS]."""
    corner = images[:, :, :2, :2].to(torch.float64).sum(dim=1).reshape(images.shape[0], -1)
    evidence = corner @ WEIGHTS
    return torch.stack([torch.zeros_like(evidence), evidence], dim=1)


def states_equal(a, b):
    return all(torch.equal(a.state()[k], b.state()[k]) for k in a.state())


def test_deletion_and_insertion_by_hand():
    images, maps, labels = torch.ones(1, 1, 2, 2), WEIGHTS.reshape(1, 2, 2), torch.tensor([1])
    deletion = RiseDeletion(linear_model, fractions=HALVES, score="logit")
    deletion.update(images, labels, maps)
    result = deletion.compute()
    # delete weights 4 and 3, then everything: 10, 3, 0
    assert result.y == (10.0, 3.0, 0.0) and result.auc == 4.0 and not result.higher_is_better
    insertion = RiseInsertion(linear_model, fractions=HALVES, canvas=0.0, score="logit")
    insertion.update(images, labels, maps)
    result = insertion.compute()
    # insert weights 4 and 3 into a black canvas, then everything: 0, 7, 10
    assert result.y == (0.0, 7.0, 10.0) and result.auc == 0.5 * 3.5 + 0.5 * 8.5 and result.higher_is_better
    assert (result.name, result.count) == ("insertion", 1)


def test_probabilities_and_the_blurred_canvas():
    generator = torch.Generator().manual_seed(0)
    images, maps = torch.rand(2, 3, 12, 12, generator=generator), torch.randn(2, 12, 12, generator=generator)
    labels = torch.tensor([1, 0])
    insertion = RiseInsertion(linear_model, fractions=(0.0, 0.5, 1.0))
    insertion.update(images, labels, maps)

    def probability(x):
        return torch.softmax(linear_model(x), dim=1)[torch.arange(2), labels].mean().item()

    y = insertion.compute().y
    assert y[0] == pytest.approx(probability(gaussian_blur(images)), abs=1e-12)
    assert y[2] == pytest.approx(probability(images), abs=1e-12)
    deletion = RiseDeletion(linear_model, fractions=(0.0, 1.0))
    deletion.update(images, labels, maps)
    assert deletion.compute().y == pytest.approx((probability(images), probability(torch.zeros_like(images))))


def test_a_faithful_map_beats_a_reversed_one():
    generator = torch.Generator().manual_seed(2)
    images = torch.rand(4, 1, 2, 2, generator=generator)
    maps = images[:, 0] * WEIGHTS.reshape(2, 2)  # input x gradient of the linear model: exact here
    labels = torch.ones(4, dtype=torch.long)
    aucs = {}
    for name, signed in (("faithful", maps), ("reversed", -maps)):
        deletion, insertion = RiseDeletion(linear_model, HALVES), RiseInsertion(linear_model, HALVES, canvas="zero")
        deletion.update(images, labels, signed)
        insertion.update(images, labels, signed)
        aucs[name] = deletion.compute().auc, insertion.compute().auc
    assert aucs["faithful"][0] < aucs["reversed"][0] and aucs["faithful"][1] > aucs["reversed"][1]


@pytest.mark.parametrize("metric_class", [RiseDeletion, RiseInsertion])
def test_batch_of_three_equals_three_updates_and_merge_is_exact(metric_class):
    generator = torch.Generator().manual_seed(1)
    images, maps = torch.rand(3, 3, 6, 6, generator=generator), torch.randn(3, 3, 6, 6, generator=generator)
    labels = torch.tensor([1, 0, 1])
    whole, split = metric_class(linear_model), metric_class(linear_model)
    whole.update(images, labels, maps)
    parts = [metric_class(linear_model) for _ in range(3)]
    for i in range(3):
        split.update(images[i:i + 1], labels[i:i + 1], maps[i:i + 1])
        parts[i].update(images[i:i + 1], labels[i:i + 1], maps[i:i + 1])
    assert states_equal(whole, split) and states_equal(whole, parts[1].merge(parts[0]).merge(parts[2]))
    assert whole.compute() == split.compute() and len(whole.compute().y) == len(RISE_FRACTIONS)
    bounded = metric_class(linear_model, max_batch_size=5)
    bounded.update(images, labels, maps)
    assert states_equal(whole, bounded)


def test_bad_inputs_raise_input_error():
    with pytest.raises(InputError, match="score"):
        RiseDeletion(linear_model, score="accuracy")
    with pytest.raises(InputError, match="occlusion"):
        RiseInsertion(linear_model, canvas="noise")
    with pytest.raises(InputError, match="strictly increasing"):
        RiseDeletion(linear_model, fractions=(0.5, 0.2))
    metric = RiseDeletion(linear_model)
    with pytest.raises(InputError, match="dims"):
        metric.update(torch.ones(1, 2, 2), torch.tensor([1]), torch.ones(1, 2, 2))
    with pytest.raises(InputError, match="maps hold"):
        metric.update(torch.ones(2, 1, 2, 2), torch.tensor([1, 1]), torch.ones(1, 2, 2))
    with pytest.raises(InputError, match="NaN"):
        metric.update(torch.ones(1, 1, 2, 2), torch.tensor([1]), torch.full((1, 2, 2), math.inf))
    with pytest.raises(InputError, match="logits"):
        RiseDeletion(lambda x: x.sum(dim=(1, 2, 3))).update(torch.ones(1, 1, 2, 2), torch.tensor([0]),
                                                              torch.ones(1, 2, 2))
    empty = RiseInsertion(linear_model).compute()
    assert empty.count == 0 and math.isnan(empty.auc)
