"""ROAD (Rong et al. ICML 2022): the noisy linear imputation against hand-computed values and a
dense system built pixel by pixel, and the MoRF / LeRF accuracy curves."""
import pytest
import torch

from captum_transformers.errors import InputError
from captum_transformers.evaluation.images.road import ROAD, ROAD_PERCENTAGES, noisy_linear_imputation

DIRECT, DIAGONAL = 1 / 6, 1 / 12


def test_a_lone_removed_pixel_takes_the_weighted_mean_of_its_neighbours():
    image = torch.arange(1.0, 10.0, dtype=torch.float64).reshape(1, 1, 3, 3)
    centre = torch.zeros(1, 3, 3, dtype=torch.bool)
    centre[0, 1, 1] = True
    direct, diagonal = 2 + 4 + 6 + 8, 1 + 3 + 7 + 9
    out = noisy_linear_imputation(image, centre, noise=0.0)
    assert float(out[0, 0, 1, 1]) == pytest.approx(DIRECT * direct + DIAGONAL * diagonal, abs=1e-12)
    assert torch.equal(out[~centre[:, None].expand_as(out)], image[~centre[:, None].expand_as(image)])
    corner = torch.zeros(1, 3, 3, dtype=torch.bool)
    corner[0, 0, 0] = True   # neighbours inside the image only: 2 and 4 (direct), 5 (diagonal)
    expected = (DIRECT * (2 + 4) + DIAGONAL * 5) / (2 * DIRECT + DIAGONAL)
    assert float(noisy_linear_imputation(image, corner, noise=0.0)[0, 0, 0, 0]) == pytest.approx(expected, abs=1e-12)


def dense_reference(image, removed):
    """The same system, assembled pixel by pixel and solved densely (one channel)."""
    height, width = removed.shape
    unknown = [(r, c) for r in range(height) for c in range(width) if removed[r, c]]
    position = {p: i for i, p in enumerate(unknown)}
    matrix = torch.zeros(len(unknown), len(unknown), dtype=torch.float64)
    rhs = torch.zeros(len(unknown), dtype=torch.float64)
    for i, (r, c) in enumerate(unknown):
        for dr in (-1, 0, 1):
            for dc in (-1, 0, 1):
                rr, cc = r + dr, c + dc
                if (dr, dc) == (0, 0) or not (0 <= rr < height and 0 <= cc < width):
                    continue
                weight = DIAGONAL if dr and dc else DIRECT
                matrix[i, i] += weight
                if removed[rr, cc]:
                    matrix[i, position[(rr, cc)]] -= weight
                else:
                    rhs[i] += weight * image[rr, cc]
    out = image.clone()
    for (r, c), value in zip(unknown, torch.linalg.solve(matrix, rhs)):
        out[r, c] = value
    return out


@pytest.mark.parametrize("fraction", [0.1, 0.6, 0.95])
def test_imputation_solves_the_linear_system(fraction):
    g = torch.Generator().manual_seed(0)
    images = torch.rand(2, 3, 6, 7, generator=g, dtype=torch.float64)
    removed = torch.rand(2, 6, 7, generator=g) < fraction
    removed[:, 0, 0] = False   # keep one pixel
    out = noisy_linear_imputation(images, removed, noise=0.0)
    for n in range(2):
        for c in range(3):
            assert torch.allclose(out[n, c], dense_reference(images[n, c], removed[n]), atol=1e-10, rtol=0)


def test_noise_comes_from_the_generator_and_touches_removed_pixels_only():
    images = torch.rand(1, 2, 5, 5, generator=torch.Generator().manual_seed(1))
    removed = torch.zeros(1, 5, 5, dtype=torch.bool)
    removed[0, 1:4, 1:4] = True
    clean = noisy_linear_imputation(images, removed, noise=0.0)
    noisy = [noisy_linear_imputation(images, removed, 0.1, torch.Generator().manual_seed(s)) for s in (3, 3, 4)]
    assert torch.equal(noisy[0], noisy[1]) and not torch.equal(noisy[0], noisy[2])
    changed = (noisy[0] != clean)[0]
    assert bool(changed[:, removed[0]].all()) and not bool(changed[:, ~removed[0]].any())
    assert noisy[0].dtype == images.dtype


class Recorder:
    """A fixed linear classifier that keeps every input it sees."""

    def __init__(self, classes=3, pixels=2 * 6 * 6):
        self.weights = torch.randn(pixels, classes, generator=torch.Generator().manual_seed(5))
        self.seen = []

    def __call__(self, x):
        self.seen.append(x.clone())
        return x.reshape(x.shape[0], -1) @ self.weights


def data(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    images, labels = torch.rand(n, 2, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
    return images, labels, torch.randn(n, 6, 6, generator=g)


@pytest.mark.parametrize("order", ["morf", "lerf"])
def test_each_percentage_imputes_the_top_ranked_pixels(order):
    images, labels, maps = data(n=2)
    model = Recorder()
    ROAD(model, order=order, percentages=(0, 10, 50, 99), noise=0.0).per_example(images, labels, maps)
    seen = torch.cat(model.seen).reshape(4, 2, 2, 6, 6)
    for step, percentage in enumerate((0, 10, 50, 99)):
        count = int(36 * percentage / 100)   # 0, 3, 18, 35
        changed = (seen[step] != images).any(dim=1).reshape(2, -1)
        ranked = torch.sort(maps.reshape(2, -1), dim=1, descending=order == "morf", stable=True).indices
        for n in range(2):
            assert set(changed[n].nonzero().flatten().tolist()) == set(ranked[n, :count].tolist())


def test_accuracy_curve_against_argmax():
    images, labels, maps = data()
    model = Recorder()
    metric = ROAD(model, percentages=(0, 50), noise=0.0)
    correct = metric.per_example(images, labels, maps)
    clean = (model(images).argmax(dim=1) == labels)
    assert torch.equal(correct[:, 0], clean)
    metric.update(images, labels, maps)
    result = metric.compute()
    assert result.x == (0.0, 50.0) and result.count == 5 and not result.higher_is_better
    assert result.y == pytest.approx(correct.double().mean(dim=0).tolist())
    assert result.auc == pytest.approx(0.01 * 50 * (result.y[0] + result.y[1]) / 2)
    assert ROAD_PERCENTAGES[:3] == (1, 3, 5) and len(ROAD_PERCENTAGES) == 50


def test_batch_equals_single_and_merge_is_exact():
    images, labels, maps = data()
    build = lambda: ROAD(Recorder(), order="lerf", percentages=(5, 40, 80), noise=0.0)  # noqa: E731
    together = build().per_example(images, labels, maps)
    single = torch.cat([build().per_example(images[i:i + 1], labels[i:i + 1], maps[i:i + 1]) for i in range(5)])
    assert torch.equal(together, single)
    whole, left, right = build(), build(), build()
    whole.update(images, labels, maps)
    left.update(images[:2], labels[:2], maps[:2])
    right.update(images[2:], labels[2:], maps[2:])
    merged = right.merge(left)
    assert all(torch.equal(merged.state()[k], whole.state()[k]) for k in whole.state())
    assert merged.compute() == whole.compute()


def test_clear_errors():
    images, labels, maps = data()
    with pytest.raises(InputError, match="percentages"):
        ROAD(Recorder(), percentages=(10, 5))
    with pytest.raises(InputError, match="percentages"):
        ROAD(Recorder(), percentages=(50, 100))
    with pytest.raises(InputError, match="noise"):
        ROAD(Recorder(), noise=-0.1)
    with pytest.raises(InputError, match="order"):
        ROAD(Recorder(), order="random")
    with pytest.raises(InputError, match="maps hold"):
        ROAD(Recorder()).update(images, labels, maps[:2])
    with pytest.raises(InputError, match="every pixel"):
        noisy_linear_imputation(images, torch.ones(5, 6, 6, dtype=torch.bool))
    with pytest.raises(InputError, match="removed has shape"):
        noisy_linear_imputation(images, torch.ones(5, 6, 5, dtype=torch.bool))
    with pytest.raises(InputError, match="did not converge"):
        removed = torch.ones(5, 6, 6, dtype=torch.bool)
        removed[:, 0, 0] = False
        noisy_linear_imputation(images, removed, noise=0.0, max_iterations=2)
    assert ROAD(Recorder()).compute().count == 0
