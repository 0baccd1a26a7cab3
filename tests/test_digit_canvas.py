"""DigitCanvas: determinism, split disjointness, exact masks, the two-digit variant, bad input."""
import numpy as np
import pytest
import torch

pytest.importorskip("sklearn")
pytest.importorskip("skimage")

from captum_transformers.errors import InputError
from captum_transformers.tasks.digits import canvas as dc
from captum_transformers.tasks.digits.canvas import DIGIT_MEAN, DIGIT_STD, DigitCanvasSet, digit_canvases, normalize


@pytest.fixture(scope="module")
def one():
    return digit_canvases("test", "one", n=300, seed=3)


@pytest.fixture(scope="module")
def two():
    return digit_canvases("val", "two", n=300, seed=4)


def test_same_arguments_give_bit_identical_data(one):
    again = digit_canvases("test", "one", n=300, seed=3)
    for field in ("images", "masks", "labels", "sources"):
        assert torch.equal(getattr(one, field), getattr(again, field))
    other = digit_canvases("test", "one", n=300, seed=5)
    assert not torch.equal(one.images, other.images)


def test_shapes_dtypes_and_ranges(one, two):
    assert one.images.shape == (300, 3, 32, 32) and one.images.dtype == torch.float32
    assert one.masks.shape == (300, 32, 32) and one.masks.dtype == torch.bool
    assert one.labels.shape == (300,) and one.labels.dtype == torch.int64
    assert two.masks.shape == (300, 2, 32, 32) and two.labels.shape == (300, 2)
    for data in (one, two):
        assert 0.0 <= data.images.min() and data.images.max() <= 1.0
        assert set(data.labels.unique().tolist()) == set(range(10))


def test_default_size_is_one_canvas_per_source_each_once():
    data = digit_canvases("val")
    sources = dc.split_sources("val")
    assert len(data) == len(sources)
    assert sorted(data.sources.tolist()) == sources.tolist()


def test_labels_are_the_source_digits_labels(one):
    from sklearn.datasets import load_digits
    assert torch.equal(one.labels, torch.from_numpy(load_digits().target[one.sources.numpy()]).long())


def test_splits_are_disjoint_and_cover_all_sources():
    parts = {name: set(dc.split_sources(name).tolist()) for name in dc.SPLITS}
    assert not parts["train"] & parts["val"] and not parts["train"] & parts["test"] and not parts["val"] & parts["test"]
    assert set.union(*parts.values()) == set(range(1797))
    assert [len(parts[name]) for name in dc.SPLITS] == [1078, 359, 360]


def test_canvases_use_only_their_split_sources_including_distractors():
    for split in dc.SPLITS:
        for variant in dc.VARIANTS:
            plan = dc._plan(split, variant, 200, 1)
            allowed = set(dc.split_sources(split).tolist())
            assert set(plan.sources.flatten().tolist()) <= allowed
            assert set(plan.distractor_sources.flatten().tolist()) <= allowed


def test_distractors_are_scrambled_digits_of_the_same_intensities():
    plan = dc._plan("test", "one", 40, 2)
    digits, _ = dc._digits()
    for alpha, sources in zip(plan.distractor_alpha, plan.distractor_sources):
        for canvas, source in zip(alpha, sources):
            upscaled = dc._upscale(digits[source])
            opacity = canvas.max() / upscaled.max()
            # Same multiset of values as the source digit (times the opacity) ...
            assert np.allclose(np.sort(canvas[canvas > 0]), np.sort(upscaled[upscaled > 0]) * opacity, atol=1e-6)
            # ... on 2x2 blocks (nearest upscaling of a permuted 8x8 image) at some offset holding all of it.
            assert any(np.isclose(canvas[r:r + 16, c:c + 16].sum(), canvas.sum())
                       and np.array_equal(dc._upscale(canvas[r:r + 16:2, c:c + 16:2]), canvas[r:r + 16, c:c + 16])
                       for r in range(17) for c in range(17))


def test_masks_are_exactly_the_pixels_the_digit_changes():
    plan = dc._plan("test", "one", 200, 7)
    with_digit = dc._render(plan)
    without_digit = dc._render(plan, with_digits=False)
    data = digit_canvases("test", "one", n=200, seed=7)
    masks = data.masks.numpy()
    assert np.array_equal(with_digit, data.images.numpy())
    changed = np.abs(with_digit - without_digit).max(1) > 0
    # Every mask pixel is drawn by the digit (alpha > MASK_ALPHA), every changed pixel outside is faint.
    alpha = plan.digit_alpha[0]
    assert np.array_equal(masks, alpha > dc.MASK_ALPHA)
    assert np.all(alpha[~masks] <= dc.MASK_ALPHA)
    assert (changed & masks).sum() >= 0.99 * masks.sum()  # ties: digit colour equal to what lies beneath
    # The digit is drawn last: its pixels equal (1 - a) * below + a * colour exactly, nothing covers them.
    colour = plan.digit_colour[0][:, :, None, None]
    expected = np.clip((1 - alpha[:, None]) * np.clip(without_digit, 0, 1) + alpha[:, None] * colour, 0, 1)
    assert np.allclose(with_digit[np.broadcast_to(masks[:, None], with_digit.shape)],
                       expected[np.broadcast_to(masks[:, None], with_digit.shape)], atol=1e-6)


def test_mask_is_the_thresholded_upscaled_source_digit_in_its_box():
    plan = dc._plan("test", "one", 50, 8)
    data = digit_canvases("test", "one", n=50, seed=8)
    digits, _ = dc._digits()
    for mask, alpha, source in zip(data.masks.numpy(), plan.digit_alpha[0], data.sources.numpy()):
        upscaled = dc._upscale(digits[source])
        opacity = alpha.max() / upscaled.max()
        assert dc.OPACITY[0] <= opacity <= dc.OPACITY[1]
        # The digit's alpha is the upscaled source times its opacity at exactly one offset, zero elsewhere.
        hits = [(r, c) for r in range(17) for c in range(17)
                if np.isclose(alpha[r:r + 16, c:c + 16].sum(), alpha.sum())
                and np.allclose(alpha[r:r + 16, c:c + 16], upscaled * opacity, atol=1e-6)]
        assert hits
        r, c = hits[0]
        expected = np.zeros_like(mask)
        expected[r:r + 16, c:c + 16] = upscaled * opacity > dc.MASK_ALPHA
        assert np.array_equal(mask, expected)


def test_two_digit_labels_differ_and_masks_do_not_overlap(two):
    assert bool((two.labels[:, 0] != two.labels[:, 1]).all())
    assert not bool((two.masks[:, 0] & two.masks[:, 1]).any())
    assert bool(two.masks.flatten(2).any(-1).all())  # each digit has a mask


def test_two_digit_masks_are_not_covered():
    plan = dc._plan("val", "two", 100, 9)
    images = dc._render(plan)
    without = dc._render(plan, with_digits=False)
    first_only = np.clip(dc._composite(without, plan.digit_alpha[0], plan.digit_colour[0]), 0, 1)
    # The second digit's boxes do not touch the first one's, so on the first mask both renders agree.
    mask0 = np.broadcast_to(plan.digit_alpha[0][:, None] > dc.MASK_ALPHA, images.shape)
    assert np.allclose(images[mask0], first_only[mask0], atol=1e-6)


def test_slicing_and_batches_return_sets(one):
    part = one[10:20]
    assert isinstance(part, DigitCanvasSet) and len(part) == 10
    assert torch.equal(part.images, one.images[10:20])
    assert len(one[5]) == 1 and torch.equal(one[5].labels, one.labels[5:6])
    sizes = [len(batch) for batch in one.batches(128)]
    assert sizes == [128, 128, 44]
    assert torch.equal(torch.cat([b.masks for b in one.batches(128)]), one.masks)


def test_normalize_uses_the_constants():
    x = torch.tensor(DIGIT_MEAN).view(1, 3, 1, 1).expand(2, 3, 4, 4)
    assert torch.allclose(normalize(x), torch.zeros(2, 3, 4, 4))
    y = x + torch.tensor(DIGIT_STD).view(1, 3, 1, 1)
    assert torch.allclose(normalize(y), torch.ones(2, 3, 4, 4), atol=1e-6)


def test_constants_match_train_statistics():
    data = torch.cat([digit_canvases("train", variant, n=1024, seed=0).images for variant in ("one", "two")])
    pixels = data.transpose(0, 1).reshape(3, -1)
    assert torch.allclose(pixels.mean(1), torch.tensor(DIGIT_MEAN), atol=0.01)
    assert torch.allclose(pixels.std(1), torch.tensor(DIGIT_STD), atol=0.01)


@pytest.mark.parametrize("kwargs, word", [
    (dict(split="training"), "split"), (dict(variant="three"), "variant"), (dict(n=-1), "n"),
    (dict(n=2.5), "n"), (dict(seed=-3), "seed"), (dict(clutter=1.5), "clutter"), (dict(clutter=-0.1), "clutter")])
def test_bad_arguments_raise_input_error(kwargs, word):
    with pytest.raises(InputError, match=word):
        digit_canvases(**kwargs)


def test_bad_batch_size_and_normalize_input(one):
    with pytest.raises(InputError, match="batch_size"):
        next(one.batches(0))
    with pytest.raises(InputError, match="normalize"):
        normalize(torch.zeros(3, 32, 32))


def test_one_digit_boxes_stay_within_the_jitter_of_the_centre(one):
    rows = one.masks.any(2).float().argmax(1)   # first row of the mask; the box starts at or above it
    cols = one.masks.any(1).float().argmax(1)
    centre = (dc.CANVAS - dc.DIGIT) // 2
    assert int(rows.min()) >= centre - dc.POSITION_JITTER and int(cols.min()) >= centre - dc.POSITION_JITTER
    last = dc.CANVAS - 1 - one.masks.any(2).flip(1).float().argmax(1)
    assert int(last.max()) <= centre + dc.POSITION_JITTER + dc.DIGIT - 1


def test_clutter_fades_background_and_distractors_but_not_digits():
    full = digit_canvases("train", "one", n=16, seed=5)
    clean = digit_canvases("train", "one", n=16, seed=5, clutter=0.0)
    assert torch.equal(full.masks, clean.masks) and torch.equal(full.labels, clean.labels)
    outside = ~clean.masks[:, None].expand_as(clean.images)
    # digits on black: outside the mask only the digit's faintest rim (alpha <= MASK_ALPHA) remains
    assert float(clean.images[outside].max()) <= dc.MASK_ALPHA + 1e-6
    assert float(full.images[outside].mean()) > 0.1                # texture and distractors
    half = digit_canvases("train", "one", n=16, seed=5, clutter=0.5)
    assert 0.0 < float(half.images[outside].mean()) < float(full.images[outside].mean())
