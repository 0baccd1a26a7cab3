"""PixelPerturbation on a toy model whose decision depends only on the pixels of one square."""
import pytest
import torch

from captum_transformers.errors import InputError
from captum_transformers.evaluation import PixelPerturbation

SIZE, THRESHOLD = 8, 0.4
OBJECT = torch.zeros(SIZE, SIZE, dtype=torch.bool)
OBJECT[2:6, 2:6] = True  # 16 of 64 pixels


class ObjectModel:
    """Class 1 iff the mean of the object pixels exceeds THRESHOLD; counts its calls."""

    def __init__(self):
        self.calls, self.rows, self.min_seen = 0, 0, float("inf")

    def __call__(self, images):
        self.calls += 1
        self.rows += images.shape[0]
        self.min_seen = min(self.min_seen, float(images.min()))
        score = images[:, 0][:, OBJECT].mean(dim=1)
        return torch.stack([torch.full_like(score, THRESHOLD), score], dim=1)


def make_batch(n=12, seed=0):
    generator = torch.Generator().manual_seed(seed)
    images = 0.5 + 0.5 * torch.rand(n, 3, SIZE, SIZE, generator=generator)
    jitter = 0.01 * torch.rand(n, SIZE, SIZE, generator=generator)  # no ties inside the object or outside
    perfect = OBJECT.double() + jitter
    random = torch.rand(n, SIZE, SIZE, generator=generator)
    return images, torch.ones(n, dtype=torch.long), {"perfect": perfect, "random": random, "reversed": -perfect}


def run(maps, mode, **options):
    images, labels, _ = make_batch()
    metric = PixelPerturbation(ObjectModel(), mode=mode, **options)
    metric.update(images, labels, maps)
    return metric.compute()


def test_positive_and_negative_orderings():
    _, _, maps = make_batch()
    positive = {name: run(m, "positive") for name, m in maps.items()}
    negative = {name: run(m, "negative") for name, m in maps.items()}
    assert positive["perfect"].auc < positive["random"].auc < positive["reversed"].auc
    assert negative["perfect"].auc > negative["random"].auc > negative["reversed"].auc
    assert not positive["perfect"].higher_is_better and negative["perfect"].higher_is_better


def test_known_curves():
    _, _, maps = make_batch()
    perfect = run(maps["perfect"], "positive", fractions="cvpr21")
    # int(64 * 0.3) = 19 >= 16: the whole object is black from f = 0.3 on.
    assert perfect.y[0] == 1.0 and perfect.y[3:] == (0.0,) * 7
    reversed_ = run(maps["reversed"], "positive", fractions="cvpr21")
    # Up to f = 0.7 (44 pixels) only background goes: the object is intact.
    assert reversed_.y[:8] == (1.0,) * 8
    assert perfect.x == tuple(i / 10 for i in range(10)) and perfect.count == 12
    expected_auc = 100 * sum((a + b) / 2 * 0.1 for a, b in zip(perfect.y, perfect.y[1:]))
    assert perfect.auc == pytest.approx(expected_auc, abs=1e-9)


def test_cvpr21_protocol_reproduces_the_authors_steps_exactly():
    # Recorded with the package before the fine default existed (0.0, 0.1, ..., 0.9 were then
    # the only steps): the same counts and the same float AUC, bit for bit.
    images, labels, maps = make_batch()
    recorded = {"positive": ([12, 12, 12, 11, 5, 0, 0, 0, 0, 0], 38.33333333333333),
                "negative": ([12, 12, 12, 12, 10, 6, 1, 1, 0, 0], 50.0)}
    for mode, (correct, auc) in recorded.items():
        metric = PixelPerturbation(ObjectModel(), mode=mode, fractions="cvpr21")
        metric.update(images, labels, maps["random"])
        assert metric.state()["correct"].tolist() == correct
        assert metric.compute().auc == auc
        assert metric.compute().x == tuple(i / 10 for i in range(10))


def test_fine_default_resolves_the_first_tenth_and_integrates_over_uneven_steps():
    _, _, maps = make_batch()
    perfect = run(maps["perfect"], "positive")
    expected_x = (0.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.09, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    assert perfect.x == expected_x
    # int(64 * f) pixels go: 0 at f = 0.01, 1 at 0.02, ..., 5 at 0.09, 6 at 0.1, 12 at 0.2.
    # The perfect map blackens object pixels first; with 6 of 16 black the object mean is
    # still above 0.4 (pixels in [0.5, 1]), with 12 it is below.
    assert perfect.y[:11] == (1.0,) * 11 and perfect.y[11:] == (0.0,) * 8
    hand = 0.0
    for i in range(len(expected_x) - 1):
        hand += (expected_x[i + 1] - expected_x[i]) * (perfect.y[i] + perfect.y[i + 1]) / 2
    assert perfect.auc == pytest.approx(100 * hand, abs=1e-12)
    coarse = run(maps["perfect"], "positive", fractions="cvpr21")
    assert perfect.y[10] == coarse.y[1] and perfect.y[11] == coarse.y[2]  # shared steps agree


def test_auc_over_explicit_uneven_fractions_is_the_hand_trapezoid():
    _, _, maps = make_batch()
    fractions = (0.0, 0.05, 0.15, 0.4, 0.9)
    result = run(maps["random"], "positive", fractions=fractions)
    widths = (0.05, 0.1, 0.25, 0.5)
    hand = sum(w * (a + b) / 2 for w, a, b in zip(widths, result.y, result.y[1:]))
    assert result.x == fractions and result.auc == pytest.approx(100 * hand, abs=1e-12)
    even = sum((a + b) / 2 for a, b in zip(result.y, result.y[1:])) * 0.9 / 4  # equal widths would be wrong
    assert abs(result.auc - 100 * even) > 1.0


def test_normalize_is_applied_after_removal_and_calls_are_stacked():
    images, labels, maps = make_batch()
    model = ObjectModel()
    metric = PixelPerturbation(model, fractions="cvpr21", normalize=lambda x: 2 * x - 1)
    metric.update(images, labels, maps["random"])
    assert model.min_seen == -1.0  # removed pixels are 0 in [0, 1] space, then normalised
    assert model.calls == 1 and model.rows == 10 * len(images)
    bounded_model = ObjectModel()
    bounded = PixelPerturbation(bounded_model, fractions="cvpr21", normalize=lambda x: 2 * x - 1, max_batch_size=25)
    bounded.update(images, labels, maps["random"])
    assert bounded_model.calls == 5 and bounded_model.rows == 10 * len(images)
    assert torch.equal(bounded.state()["correct"], metric.state()["correct"])


def test_channel_maps_are_summed():
    images, labels, maps = make_batch()
    per_channel = maps["random"][:, None].repeat(1, 3, 1, 1) * torch.tensor([0.2, 0.3, 0.5])[None, :, None, None]
    a, b = PixelPerturbation(ObjectModel()), PixelPerturbation(ObjectModel())
    a.update(images, labels, per_channel)
    b.update(images, labels, per_channel.sum(dim=1, keepdim=True))
    assert torch.equal(a.state()["correct"], b.state()["correct"])


def test_two_updates_equal_one_update_on_the_concatenation():
    images, labels, maps = make_batch()
    whole, split = PixelPerturbation(ObjectModel()), PixelPerturbation(ObjectModel())
    whole.update(images, labels, maps["random"])
    split.update(images[:5], labels[:5], maps["random"][:5])
    split.update(images[5:], labels[5:], maps["random"][5:])
    assert all(torch.equal(whole.state()[k], split.state()[k]) for k in whole.state())
    assert whole.compute() == split.compute()


@pytest.mark.parametrize("bad", [
    lambda imgs, labels, maps: (imgs, labels, maps[:, :4]),              # map size differs from the image
    lambda imgs, labels, maps: (imgs, labels.float(), maps),             # float labels
    lambda imgs, labels, maps: (imgs[0], labels, maps),                  # no batch dim
    lambda imgs, labels, maps: (imgs, labels, maps[:, None].repeat(1, 2, 1, 1)),  # 2 channels for 3
    lambda imgs, labels, maps: (imgs, labels[:3], maps),                 # label count
])
def test_bad_inputs_raise_input_error(bad):
    images, labels, maps = make_batch()
    with pytest.raises(InputError):
        PixelPerturbation(ObjectModel()).update(*bad(images, labels, maps["random"]))


def test_bad_options_raise_input_error():
    with pytest.raises(InputError, match="mode"):
        PixelPerturbation(ObjectModel(), mode="both")
    with pytest.raises(InputError, match="fractions"):
        PixelPerturbation(ObjectModel(), fractions=(0.5, 0.1))
    with pytest.raises(InputError, match="names no pixel perturbation protocol"):
        PixelPerturbation(ObjectModel(), fractions="cvpr2021")
    with pytest.raises(InputError, match="max_batch_size"):
        PixelPerturbation(ObjectModel(), max_batch_size=0)


def test_empty_metric_reports_nan_with_zero_count():
    result = PixelPerturbation(ObjectModel()).compute()
    assert result.count == 0 and result.auc != result.auc
