"""DigitCanvas: real handwritten digits on real textures, with exact segmentation masks.

Each 32x32 RGB canvas is built from data that ships inside PyPI packages (nothing is
downloaded):

1. background: a 32x32 crop of one of scikit-image's bundled grey textures
   (``brick``, ``grass``, ``gravel``), tinted with a random colour and contrast and kept in
   the darker part of the range;
2. two distractors: another source digit whose 64 pixels are randomly permuted (same
   intensity statistics as a digit, no shape), upscaled and drawn at a random place with
   opacity ``DISTRACTOR_OPACITY``;
3. the true digit(s), drawn last so nothing covers them: a scikit-learn 8x8 digit
   (``load_digits``, values 0..16) upscaled x2 by *nearest neighbour* (each pixel becomes a
   2x2 block, so the mask is exact at pixel level), alpha-composited with
   ``alpha = opacity * intensity / 16``, opacity in ``OPACITY``.

Strokes (digits and distractors alike) take a random hue brighter than their background, so
colour is no cue to which stroke is the digit; shape (and the distractors' fainter opacity)
is.

The mask of a digit is ``alpha > MASK_ALPHA`` over its 16x16 box: exactly the pixels
whose value the digit changed. Variant ``"two"`` draws two digits of *different* classes
in non-overlapping boxes (side by side or stacked), one mask and one label per digit.

The 1797 source digits are split once (seed ``SPLIT_SEED``) into train / val / test
(60 / 20 / 20 %); a canvas only uses digits (true ones and distractors) of its own split.

Example::

    >>> from captum_transformers.tasks.digits.canvas import digit_canvases, normalize
    >>> data = digit_canvases("test", n=8)
    >>> data.images.shape, data.masks.shape, data.labels.shape
    (torch.Size([8, 3, 32, 32]), torch.Size([8, 32, 32]), torch.Size([8]))
    >>> x = normalize(data.images)    # what the model takes
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Dict, Iterator, Optional, Tuple

import numpy as np
import torch

from ...errors import InputError

CANVAS = 32
DIGIT = 16  # an 8x8 source digit upscaled x2
SCALE = DIGIT // 8
SPLITS = ("train", "val", "test")
VARIANTS = ("one", "two")
SPLIT_SEED = 0
SPLIT_FRACTIONS = (0.6, 0.2, 0.2)
TEXTURES = ("brick", "grass", "gravel")
DISTRACTORS = 2
# Alpha at or below this is not counted as digit: it drops the faintest source values (1/16
# at any opacity), the rim of a stroke that barely changes its pixel.
MASK_ALPHA = 0.1
# Difficulty: the texture's contrast and brightness, the background's tint per channel, the
# stroke colours per channel, and the strokes' opacity (all drawn uniformly per canvas / stroke).
TEXTURE_CONTRAST = (0.15, 0.35)
BACKGROUND_OFFSET = (0.0, 0.25)
BACKGROUND_TINT = (0.6, 1.0)
STROKE_RANGE = (0.6, 1.0)
OPACITY = (0.8, 1.0)
# Distractors are fainter than digits: still salient strokes that draw attention, but an
# easier task for a tiny ViT trained for minutes on a CPU (a difficulty knob, chosen, not tuned).
DISTRACTOR_OPACITY = (0.35, 0.6)
# A digit's box sits within +-POSITION_JITTER pixels of its home (the centre for one digit;
# for two, each half along the split axis is fixed and the other axis jitters). Unrestricted
# placement left a 4-layer ViT near chance for thousands of CPU steps; this keeps the task
# learnable in minutes while the distractors still roam the whole canvas.
POSITION_JITTER = 3

# Per-channel statistics of train canvases (both variants, 4096 each, seed 0), rounded;
# constants so that normalising never depends on generating data first.
DIGIT_MEAN: Tuple[float, float, float] = (0.2929, 0.2931, 0.2932)
DIGIT_STD: Tuple[float, float, float] = (0.1810, 0.1805, 0.1809)


def normalize(images01: torch.Tensor) -> torch.Tensor:
    """Model input from canvases in [0, 1]: ``(x - DIGIT_MEAN[c]) / DIGIT_STD[c]`` per channel.

    Example::

        >>> normalize(torch.zeros(1, 3, 32, 32)).shape
        torch.Size([1, 3, 32, 32])
    """
    if not isinstance(images01, torch.Tensor) or images01.dim() != 4 or images01.shape[1] != 3:
        shape = tuple(images01.shape) if isinstance(images01, torch.Tensor) else type(images01).__name__
        raise InputError(f"normalize expects a float tensor of shape (N, 3, H, W) with values in [0, 1], "
                         f"received {shape}. Pass DigitCanvasSet.images (or a slice of it).")
    mean = images01.new_tensor(DIGIT_MEAN).view(1, 3, 1, 1)
    std = images01.new_tensor(DIGIT_STD).view(1, 3, 1, 1)
    return (images01 - mean) / std


@dataclass(frozen=True)
class DigitCanvasSet:
    """A batch of canvases with their ground truth.

    ``images`` float32 (N, 3, 32, 32) in [0, 1]; ``masks`` bool (N, 32, 32) for variant
    ``"one"``, (N, 2, 32, 32) for ``"two"``; ``labels`` int64 (N,) or (N, 2); ``sources``
    int64 like ``labels``: the index of each true digit in ``sklearn.datasets.load_digits``.
    Indexing with an int, slice, index tensor or bool tensor returns a ``DigitCanvasSet``.
    """

    images: torch.Tensor
    masks: torch.Tensor
    labels: torch.Tensor
    sources: torch.Tensor

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index) -> "DigitCanvasSet":
        if isinstance(index, int):
            index = slice(index, index + 1 if index != -1 else None)
        return DigitCanvasSet(self.images[index], self.masks[index], self.labels[index], self.sources[index])

    def batches(self, batch_size: int) -> Iterator["DigitCanvasSet"]:
        """Consecutive slices of at most ``batch_size`` canvases, in order."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise InputError(f"batch_size must be a positive int, received {batch_size!r}.")
        for start in range(0, len(self), batch_size):
            yield self[start:start + batch_size]


@functools.lru_cache(maxsize=1)
def _digits() -> Tuple[np.ndarray, np.ndarray]:
    """All 1797 scikit-learn digits as float32 (1797, 8, 8) in [0, 1], and their int64 labels."""
    from sklearn.datasets import load_digits
    bunch = load_digits()
    return (bunch.images / 16.0).astype(np.float32), bunch.target.astype(np.int64)


@functools.lru_cache(maxsize=1)
def _split_sources() -> Dict[str, np.ndarray]:
    """Disjoint sorted source indices per split, from one seeded permutation of 0..1796."""
    count = len(_digits()[1])
    order = np.random.default_rng(SPLIT_SEED).permutation(count)
    n_train = int(round(SPLIT_FRACTIONS[0] * count))
    n_val = int(round(SPLIT_FRACTIONS[1] * count))
    parts = (order[:n_train], order[n_train:n_train + n_val], order[n_train + n_val:])
    return {name: np.sort(part) for name, part in zip(SPLITS, parts)}


def split_sources(split: str) -> np.ndarray:
    """Indices into ``load_digits()`` of the source digits that ``split`` may use (sorted).

    Example::

        >>> len(split_sources("train")) + len(split_sources("val")) + len(split_sources("test"))
        1797
    """
    _check_choice("split", split, SPLITS)
    return _split_sources()[split].copy()


@functools.lru_cache(maxsize=1)
def _textures() -> np.ndarray:
    """The bundled grey textures as float32 (T, 512, 512) in [0, 1]."""
    import skimage.data
    return np.stack([getattr(skimage.data, name)().astype(np.float32) / 255.0 for name in TEXTURES])


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise InputError(f"Unknown {name} {value!r}; expected one of {', '.join(map(repr, choices))}.")


def _upscale(digits: np.ndarray) -> np.ndarray:
    """(..., 8, 8) -> (..., 16, 16) by nearest neighbour (each pixel a 2x2 block)."""
    return digits.repeat(SCALE, axis=-2).repeat(SCALE, axis=-1)


def _place(patches: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Paste (N, 16, 16) patches into zero (N, 32, 32) canvases with top-left corners (rows, cols)."""
    n = len(patches)
    out = np.zeros((n, CANVAS, CANVAS), dtype=np.float32)
    offsets = np.arange(DIGIT)
    out[np.arange(n)[:, None, None], rows[:, None, None] + offsets[None, :, None],
        cols[:, None, None] + offsets[None, None, :]] = patches
    return out


def _colours(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random light stroke colours (n, 3): each channel in ``STROKE_RANGE``, so a random tint.

    True digits and distractors draw from this same distribution, so colour is no cue to
    which stroke is the digit.
    """
    return rng.uniform(*STROKE_RANGE, size=(n, 3)).astype(np.float32)


def _opacities(rng: np.random.Generator, n: int, bounds: Tuple[float, float]) -> np.ndarray:
    return rng.uniform(*bounds, size=(n, 1, 1)).astype(np.float32)


def _backgrounds(rng: np.random.Generator, n: int) -> np.ndarray:
    """(n, 3, 32, 32) texture crops: ``tint_c * (offset + contrast * texture)``, drawn per canvas."""
    textures = _textures()
    which = rng.integers(0, len(textures), size=n)
    top = rng.integers(0, textures.shape[1] - CANVAS + 1, size=n)
    left = rng.integers(0, textures.shape[2] - CANVAS + 1, size=n)
    offsets = np.arange(CANVAS)
    crops = textures[which[:, None, None], top[:, None, None] + offsets[None, :, None],
                     left[:, None, None] + offsets[None, None, :]]
    contrast = rng.uniform(*TEXTURE_CONTRAST, size=(n, 1, 1, 1)).astype(np.float32)
    offset = rng.uniform(*BACKGROUND_OFFSET, size=(n, 1, 1, 1)).astype(np.float32)
    tint = rng.uniform(*BACKGROUND_TINT, size=(n, 3, 1, 1)).astype(np.float32)
    return tint * (offset + contrast * crops[:, None])


def _composite(canvas: np.ndarray, alpha: np.ndarray, colour: np.ndarray) -> np.ndarray:
    """Alpha blending ``(1 - a) * canvas + a * colour`` with alpha (N, 32, 32), colour (N, 3)."""
    a = alpha[:, None]
    return (1.0 - a) * canvas + a * colour[:, :, None, None]


def _partners(rng: np.random.Generator, pool: np.ndarray, labels: np.ndarray, first: np.ndarray) -> np.ndarray:
    """For each source in ``first``, a source of ``pool`` with a different class (redrawn until so)."""
    second = rng.choice(pool, size=len(first))
    same = labels[second] == labels[first]
    while same.any():  # vectorised rejection: ~1/10 redrawn per round
        second[same] = rng.choice(pool, size=int(same.sum()))
        same = labels[second] == labels[first]
    return second


def _layouts(rng: np.random.Generator, n: int, variant: str) -> Tuple[np.ndarray, np.ndarray]:
    """Top-left corners (n, k) rows and cols of the k true digits.

    One digit: within ``POSITION_JITTER`` of the centred box. Two digits use disjoint boxes:
    side by side (cols 0 and 16) or stacked (rows 0 and 16), jittered like one digit along the
    other axis.
    """
    centre = (CANVAS - DIGIT) // 2
    low, high = centre - POSITION_JITTER, centre + POSITION_JITTER
    if variant == "one":
        return rng.integers(low, high + 1, size=(n, 1)), rng.integers(low, high + 1, size=(n, 1))
    stacked = rng.random(n) < 0.5
    fixed = np.broadcast_to(np.array([0, DIGIT]), (n, 2))
    loose = rng.integers(low, high + 1, size=(n, 2))
    first_box_first = rng.random(n) < 0.5  # which digit takes the top/left box
    fixed = np.where(first_box_first[:, None], fixed, fixed[:, ::-1])
    rows = np.where(stacked[:, None], fixed, loose)
    cols = np.where(stacked[:, None], loose, fixed)
    return rows, cols


@dataclass(frozen=True)
class _Plan:
    """Every random choice of a batch, so a canvas can be rendered with or without its digits."""

    backgrounds: np.ndarray       # (N, 3, 32, 32)
    distractor_alpha: np.ndarray  # (D, N, 32, 32)
    distractor_colour: np.ndarray  # (D, N, 3)
    distractor_sources: np.ndarray  # (D, N) digits whose pixels were scrambled
    digit_alpha: np.ndarray       # (K, N, 32, 32)
    digit_colour: np.ndarray      # (K, N, 3)
    labels: np.ndarray            # (N, K)
    sources: np.ndarray           # (N, K)


def _plan(split: str, variant: str, n: Optional[int], seed: int) -> _Plan:
    _check_choice("split", split, SPLITS)
    _check_choice("variant", variant, VARIANTS)
    if n is not None and (not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0):
        raise InputError(f"n must be None (one canvas per source digit of the split) or an int >= 0, received {n!r}.")
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise InputError(f"seed must be an int >= 0, received {seed!r}.")
    digits, all_labels = _digits()
    pool = _split_sources()[split]
    rng = np.random.default_rng([int(seed), SPLITS.index(split), VARIANTS.index(variant)])
    count = len(pool) if n is None else int(n)

    # Every source of the split once per round, rounds shuffled, as many as n needs.
    rounds = -(-count // len(pool)) if count else 0
    first = np.concatenate([rng.permutation(pool) for _ in range(rounds)] or [pool[:0]])[:count]
    sources = first[:, None] if variant == "one" else np.stack(
        [first, _partners(rng, pool, all_labels, first)], axis=1)

    backgrounds = _backgrounds(rng, count)
    free = CANVAS - DIGIT
    distractor_sources = rng.choice(pool, size=(DISTRACTORS, count))
    scrambled = rng.permuted(digits[distractor_sources].reshape(DISTRACTORS, count, 64),
                             axis=-1).reshape(DISTRACTORS, count, 8, 8)
    distractor_alpha = np.stack([
        _place(_upscale(scrambled[d]) * _opacities(rng, count, DISTRACTOR_OPACITY),
               rng.integers(0, free + 1, size=count), rng.integers(0, free + 1, size=count))
        for d in range(DISTRACTORS)])
    distractor_colour = np.stack([_colours(rng, count) for _ in range(DISTRACTORS)])

    rows, cols = _layouts(rng, count, variant)
    k = sources.shape[1]
    digit_alpha = np.stack([
        _place(_upscale(digits[sources[:, j]]) * _opacities(rng, count, OPACITY), rows[:, j], cols[:, j])
        for j in range(k)])
    digit_colour = np.stack([_colours(rng, count) for _ in range(k)])
    return _Plan(backgrounds, distractor_alpha, distractor_colour, distractor_sources, digit_alpha, digit_colour,
                 all_labels[sources], sources)


def _render(plan: _Plan, with_digits: bool = True) -> np.ndarray:
    """Composite background, distractors, then (optionally) the true digits; (N, 3, 32, 32)."""
    canvas = plan.backgrounds
    for alpha, colour in zip(plan.distractor_alpha, plan.distractor_colour):
        canvas = _composite(canvas, alpha, colour)
    if with_digits:
        for alpha, colour in zip(plan.digit_alpha, plan.digit_colour):
            canvas = _composite(canvas, alpha, colour)
    return np.clip(canvas, 0.0, 1.0)


def digit_canvases(split: str = "test", variant: str = "one", n: Optional[int] = None,
                   seed: int = 0, clutter: float = 1.0) -> DigitCanvasSet:
    """Generate DigitCanvas images with exact masks and labels (deterministic in all arguments).

    ``split`` in {"train", "val", "test"} picks the source digits (disjoint per split);
    ``variant`` "one" draws one true digit per canvas, "two" two digits of different
    classes in non-overlapping boxes; ``n`` canvases (default: one per source digit of the
    split, each source once); ``seed`` selects the random layout; ``clutter`` in [0, 1] scales
    the texture background and the distractors' opacity (1: the benchmark canvases; 0: the
    digits alone on black, for a training curriculum; the layout and digits do not change
    with it). Same arguments give bit-identical tensors. See the module docstring for the construction.

    Example::

        >>> pair = digit_canvases("val", variant="two", n=4, seed=1)
        >>> bool((pair.labels[:, 0] != pair.labels[:, 1]).all()), pair.masks.shape
        (True, torch.Size([4, 2, 32, 32]))
    """
    if not isinstance(clutter, (int, float)) or isinstance(clutter, bool) or not 0.0 <= clutter <= 1.0:
        raise InputError(f"clutter must be a number in [0, 1] (1 = the benchmark canvases), received {clutter!r}.")
    plan = _plan(split, variant, n, seed)
    if clutter != 1.0:
        plan = dataclasses.replace(plan, backgrounds=plan.backgrounds * np.float32(clutter),
                                   distractor_alpha=plan.distractor_alpha * np.float32(clutter))
    masks = plan.digit_alpha.transpose(1, 0, 2, 3) > MASK_ALPHA
    labels, sources = plan.labels, plan.sources
    if variant == "one":
        masks, labels, sources = masks[:, 0], labels[:, 0], sources[:, 0]
    return DigitCanvasSet(
        images=torch.from_numpy(np.ascontiguousarray(_render(plan), dtype=np.float32)),
        masks=torch.from_numpy(np.ascontiguousarray(masks)),
        labels=torch.from_numpy(np.ascontiguousarray(labels, dtype=np.int64)),
        sources=torch.from_numpy(np.ascontiguousarray(sources, dtype=np.int64)),
    )
