"""PixelFlipping and RegionPerturbation (Quantus 0.6.0 definitions) on hand-computed cases."""
import pytest
import torch

from captum_transformers.errors import InputError
from captum_transformers.evaluation.images.pixel_flipping import (PixelFlipping, RegionPerturbation, baseline_values,
                                                           stable_order)

IMAGE = torch.tensor([[[[0.5, 0.2], [0.9, 0.4]]]])          # 1 x 1 x 2 x 2
MAP = torch.tensor([[[0.1, 0.7], [0.3, 0.9]]])              # order: pixel 3, 1, 2, 0
LABEL = torch.tensor([1])


class SumModel:
    """Logits (0, sum of all pixels); records what it sees."""

    def __init__(self):
        self.seen = []

    def __call__(self, x):
        self.seen.append(x.clone())
        total = x.reshape(x.shape[0], -1).sum(dim=1)
        return torch.stack([torch.zeros_like(total), total], dim=1)


def test_black_baseline_curve_and_auc_by_hand():
    metric = PixelFlipping(SumModel(), (2, 2), softmax=False)
    # black = min(x) = 0.2: pixel 3 -> 1.8, pixel 1 (already 0.2) -> 1.8, pixel 2 -> 1.1, pixel 0 -> 0.8
    curve = metric.per_example(IMAGE, LABEL, MAP)
    assert torch.allclose(curve, torch.tensor([[1.8, 1.8, 1.1, 0.8]], dtype=torch.float64), atol=1e-6)
    metric.update(IMAGE, LABEL, MAP)
    result = metric.compute()
    assert result.x == (1.0, 2.0, 3.0, 4.0) and result.count == 1 and not result.higher_is_better
    assert result.auc == pytest.approx((1.8 + 1.8) / 2 + (1.8 + 1.1) / 2 + (1.1 + 0.8) / 2, abs=1e-6)


def test_mean_baseline_is_the_running_mean_of_the_perturbed_image():
    curve = PixelFlipping(SumModel(), (2, 2), baseline="mean", softmax=False).per_example(IMAGE, LABEL, MAP)
    # step 1: mean 0.5 -> pixel 3 = 0.5, sum 2.1; step 2: mean (0.5+0.2+0.9+0.5)/4 = 0.525 -> pixel 1, sum 2.425
    assert curve[0, :2].tolist() == pytest.approx([2.1, 2.425], abs=1e-6)


def test_steps_of_several_pixels_and_a_partial_last_step():
    model = SumModel()
    curve = PixelFlipping(model, (2, 2), features_in_step=3, baseline=0.0, softmax=False).per_example(
        IMAGE, LABEL, MAP)
    assert curve.shape == (1, 2)   # ceil(4 / 3) steps
    assert curve[0].tolist() == pytest.approx([0.5, 0.0], abs=1e-6)   # pixels 3, 1, 2 then pixel 0


def test_softmax_scores_are_probabilities_of_the_label():
    curve = PixelFlipping(SumModel(), (2, 2)).per_example(IMAGE, LABEL, MAP)
    assert torch.allclose(curve, torch.sigmoid(torch.tensor([[1.8, 1.8, 1.1, 0.8]], dtype=torch.float64)), atol=1e-6)
    zero = PixelFlipping(SumModel(), (2, 2)).per_example(IMAGE, torch.tensor([0]), MAP)
    assert torch.allclose(zero + curve, torch.ones_like(curve), atol=1e-6)


def test_absolute_ranks_magnitudes_and_ties_keep_the_earlier_pixel_first():
    assert stable_order(torch.tensor([[0.5, 0.5, 0.9, 0.5]]), descending=True).tolist() == [[2, 0, 1, 3]]
    signed = torch.tensor([[[-0.9, 0.1], [0.2, 0.3]]])
    plain = PixelFlipping(SumModel(), (2, 2), baseline=0.0, softmax=False)
    absolute = PixelFlipping(SumModel(), (2, 2), baseline=0.0, softmax=False, absolute=True)
    assert plain.per_example(IMAGE, LABEL, signed)[0, 0] == pytest.approx(2.0 - 0.4)   # pixel 3 first
    assert absolute.per_example(IMAGE, LABEL, signed)[0, 0] == pytest.approx(2.0 - 0.5)  # pixel 0 first


def test_named_baselines():
    current = torch.tensor([[0.2, 0.5, 0.8], [0.0, 1.0, 0.5]])
    assert baseline_values("white", current, (0.0, 1.0), None).tolist() == pytest.approx([0.8, 1.0])
    assert baseline_values("mean", current, (0.0, 1.0), None).tolist() == pytest.approx([0.5, 0.5])
    draws = [baseline_values("uniform", current, (2.0, 3.0), torch.Generator().manual_seed(s)) for s in (0, 0, 1)]
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    assert bool(((draws[0] >= 2.0) & (draws[0] <= 3.0)).all())


def batch(n=6, size=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    images = torch.rand(n, 3, size, size, generator=g)
    return images, torch.randint(0, 3, (n,), generator=g), torch.randn(n, size, size, generator=g)


WEIGHTS = torch.randn(3 * 36, 3, generator=torch.Generator().manual_seed(1))


def linear(x):
    return x.reshape(x.shape[0], -1) @ WEIGHTS


@pytest.mark.parametrize("build", [lambda: PixelFlipping(linear, (6, 6), features_in_step=5),
                                   lambda: RegionPerturbation(linear, 2, "morf", 9),
                                   lambda: RegionPerturbation(linear, 4, "lerf", 4, baseline="mean")])
def test_batch_equals_single_and_merge_is_exact(build):
    images, labels, maps = batch()
    together = build().per_example(images, labels, maps)
    single = torch.cat([build().per_example(images[i:i + 1], labels[i:i + 1], maps[i:i + 1]) for i in range(6)])
    assert torch.allclose(together, single, atol=1e-6, rtol=0)
    whole, first, second = build(), build(), build()
    whole.update(images, labels, maps)
    first.update(images[:2], labels[:2], maps[:2])
    second.update(images[2:], labels[2:], maps[2:])
    merged = build().merge(second).merge(first)
    assert torch.allclose(limbs(whole.state()["curve"]), limbs(merged.state()["curve"]), atol=1e-6)
    assert merged.compute().count == 6


def limbs(state):
    from captum_transformers.evaluation.accumulator import limbs_value
    return limbs_value(state)


def test_merge_states_add_exactly():
    images, labels, maps = batch()
    parts = [PixelFlipping(linear, (6, 6), features_in_step=4) for _ in range(3)]
    for part, rows in zip(parts, (slice(0, 1), slice(1, 4), slice(4, 6))):
        part.update(images[rows], labels[rows], maps[rows])
    forward = parts[0].merge(parts[1]).merge(parts[2]).state()["curve"].clone()
    parts = [PixelFlipping(linear, (6, 6), features_in_step=4) for _ in range(3)]
    for part, rows in zip(parts, (slice(0, 1), slice(1, 4), slice(4, 6))):
        part.update(images[rows], labels[rows], maps[rows])
    assert torch.equal(parts[2].merge(parts[0]).merge(parts[1]).state()["curve"], forward)


def test_region_perturbation_by_hand():
    image = torch.arange(16.0).reshape(1, 1, 4, 4) / 16
    maps = torch.zeros(1, 4, 4)
    maps[0, 2:, :2] = 1.0      # bottom-left patch most relevant, then top-right
    maps[0, :2, 2:] = 0.5
    model = SumModel()
    drop = RegionPerturbation(model, 2, "morf", 2, baseline=0.0, softmax=False).per_example(image, LABEL, maps)
    bottom_left, top_right = (8 + 9 + 12 + 13) / 16, (2 + 3 + 6 + 7) / 16
    assert drop[0].tolist() == pytest.approx([bottom_left, bottom_left + top_right], abs=1e-6)
    lerf = RegionPerturbation(SumModel(), 2, "lerf", 1, baseline=0.0, softmax=False).per_example(image, LABEL, maps)
    assert lerf[0].tolist() == pytest.approx([(0 + 1 + 4 + 5) / 16], abs=1e-6)   # first zero-sum patch


def test_region_perturbation_pads_like_quantus():
    # 3 x 3 with 2 x 2 patches: one row / column is missing, padded after (floor 0 before, ceil 1 after).
    image = torch.arange(1.0, 10.0).reshape(1, 1, 3, 3)
    maps = torch.zeros(1, 3, 3)
    maps[0, 2, 2] = 1.0        # the bottom-right patch holds only pixel (2, 2) of the image
    model = SumModel()
    drop = RegionPerturbation(model, 2, "morf", 1, baseline=0.0, softmax=False).per_example(image, LABEL, maps)
    assert drop[0].tolist() == pytest.approx([9.0])
    assert all(seen.shape[2:] == (3, 3) for seen in model.seen)
    # "black" reads the edge-padded image: its min is the image's min.
    black = RegionPerturbation(SumModel(), 2, "morf", 1, softmax=False).per_example(image, LABEL, maps)
    assert black[0].tolist() == pytest.approx([9.0 - 1.0])


def test_clear_errors():
    images, labels, maps = batch()
    with pytest.raises(InputError, match="image_size"):
        PixelFlipping(linear, (5, 6)).update(images, labels, maps)
    with pytest.raises(InputError, match="image_size"):
        PixelFlipping(linear, 36)
    with pytest.raises(InputError, match="baseline"):
        PixelFlipping(linear, (6, 6), baseline="grey")
    with pytest.raises(InputError, match="features_in_step"):
        PixelFlipping(linear, (6, 6), features_in_step=0)
    with pytest.raises(InputError, match="maps hold"):
        PixelFlipping(linear, (6, 6)).update(images, labels, maps[:2])
    with pytest.raises(InputError, match="NaN"):
        PixelFlipping(linear, (6, 6)).update(images, labels, maps * float("nan"))
    with pytest.raises(InputError, match="only 9 patches"):
        RegionPerturbation(linear, 2, "morf", 10).update(images, labels, maps)
    with pytest.raises(InputError, match="order"):
        RegionPerturbation(linear, 2, "top")
    with pytest.raises(InputError, match="uniform_range"):
        PixelFlipping(linear, (6, 6), uniform_range=(1.0, 0.0))
    assert PixelFlipping(linear, (6, 6)).compute().count == 0
