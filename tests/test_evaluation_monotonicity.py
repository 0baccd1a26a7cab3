"""Monotonicity (Arya et al. 2019, as quantus.Monotonicity names it) on hand-computed cases."""
import pytest
import torch

from captum_transformers.errors import InputError
from captum_transformers.evaluation.monotonicity import Monotonicity

IMAGE = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])   # black baseline = 1.0
LABEL = torch.tensor([1])


class WeightedSum:
    """Logits (0, sum w * x): restoring pixel i adds w_i * (x_i - baseline)."""

    def __init__(self, weights):
        self.weights = torch.tensor(weights).reshape(1, -1)
        self.seen = []

    def __call__(self, x):
        self.seen.append(x.clone())
        total = (x.reshape(x.shape[0], -1) * self.weights).sum(dim=1)
        return torch.stack([torch.zeros_like(total), total], dim=1)


def test_curve_restores_pixels_by_rising_relevance_from_the_baseline():
    model = WeightedSum([1.0, 1.0, 1.0, 1.0])
    maps = torch.tensor([[[0.4, 0.1], [0.3, 0.2]]])        # ascending: pixel 1, 3, 2, 0
    metric = Monotonicity(model, softmax=False)
    curve = metric.curves(IMAGE, LABEL, maps)
    # start 1,1,1,1 (sum 4); +pixel 1 (2): 5; +pixel 3 (4): 8; +pixel 2 (3): 10; +pixel 0 (1): 10
    assert curve[0].tolist() == pytest.approx([5.0, 8.0, 10.0, 10.0])
    assert model.seen[0][0, 0].tolist() == [[1.0, 2.0], [1.0, 1.0]]
    assert bool(metric.per_example(IMAGE, LABEL, maps)[0])   # equal steps count as monotonic


def test_a_score_that_drops_makes_the_explanation_non_monotonic():
    maps = torch.tensor([[[0.4, 0.1], [0.3, 0.2]]])
    metric = Monotonicity(WeightedSum([1.0, 1.0, -1.0, 1.0]), softmax=False)   # restoring pixel 2 lowers the score
    # start 1 + 1 - 1 + 1 = 2; +pixel 1: 3; +pixel 3: 6; pixel 2 goes from -1 to -3: 4; +pixel 0: 4
    assert metric.curves(IMAGE, LABEL, maps)[0].tolist() == pytest.approx([3.0, 6.0, 4.0, 4.0])
    metric.update(IMAGE, LABEL, maps)
    assert metric.compute().value == 0.0 and metric.compute().count == 1


def test_absolute_is_the_default_ranking_and_can_be_turned_off():
    maps = torch.tensor([[[-0.9, 0.1], [0.3, 0.2]]])
    model = WeightedSum([1.0, 1.0, 1.0, 1.0])
    # |map| ascending: pixel 1, 3, 2, 0; signed ascending: pixel 0, 1, 3, 2
    assert Monotonicity(model, softmax=False).curves(IMAGE, LABEL, maps)[0, 0] == pytest.approx(5.0)
    assert Monotonicity(model, softmax=False, absolute=False).curves(IMAGE, LABEL, maps)[0, 0] == pytest.approx(4.0)


def test_steps_baselines_and_softmax():
    maps = torch.tensor([[[0.4, 0.1], [0.3, 0.2]]])
    model = WeightedSum([1.0, 1.0, 1.0, 1.0])
    two = Monotonicity(model, features_in_step=2, baseline=0.0, softmax=False).curves(IMAGE, LABEL, maps)
    assert two[0].tolist() == pytest.approx([6.0, 10.0])
    white = Monotonicity(model, features_in_step=4, baseline="white", softmax=False).curves(IMAGE, LABEL, maps)
    assert white[0].tolist() == pytest.approx([10.0])
    probability = Monotonicity(model, baseline=0.0).curves(IMAGE, LABEL, maps)
    assert probability[0].tolist() == pytest.approx(torch.sigmoid(torch.tensor([2.0, 6.0, 9.0, 10.0])).tolist())


def data(n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    images, labels = torch.rand(n, 2, 4, 4, generator=g), torch.randint(0, 3, (n,), generator=g)
    return images, labels, torch.randn(n, 4, 4, generator=g)


WEIGHTS = torch.randn(32, 3, generator=torch.Generator().manual_seed(3))


def linear(x):
    return x.reshape(x.shape[0], -1) @ WEIGHTS


def test_batch_equals_single_and_merge_is_exact():
    images, labels, maps = data()
    metric = Monotonicity(linear, features_in_step=8)
    together = metric.curves(images, labels, maps)
    single = torch.cat([metric.curves(images[i:i + 1], labels[i:i + 1], maps[i:i + 1]) for i in range(7)])
    assert torch.allclose(together, single, atol=1e-6, rtol=0)
    flags = Monotonicity(linear, features_in_step=8).per_example(images, labels, maps)
    assert 0 < int(flags.sum()) < 7   # the data exercise both outcomes
    whole, left, right = (Monotonicity(linear, features_in_step=8) for _ in range(3))
    whole.update(images, labels, maps)
    left.update(images[:3], labels[:3], maps[:3])
    right.update(images[3:], labels[3:], maps[3:])
    merged = left.merge(right)
    assert all(torch.equal(merged.state()[k], whole.state()[k]) for k in whole.state())
    assert merged.compute() == whole.compute()
    assert whole.compute().value == pytest.approx(float(flags.double().mean()))


def test_empty_and_errors():
    assert Monotonicity(linear).compute().count == 0
    images, labels, maps = data()
    with pytest.raises(InputError, match="maps hold"):
        Monotonicity(linear).update(images, labels, maps[:1])
    with pytest.raises(InputError, match="labels"):
        Monotonicity(linear).update(images, labels[:2], maps)
    with pytest.raises(InputError, match="baseline"):
        Monotonicity(linear, baseline="random")
