"""Monotonicity (Arya et al., "One explanation does not fit all", arXiv:1909.03012, 2019), the
metric ``quantus.Monotonicity`` names.

Starting from an all-baseline image, the pixels are put back (their original values, all
channels) in order of *increasing* relevance, ``features_in_step`` at a time; an explanation is
monotonic when the explained class's score never decreases along the way:

    y_t = p(label | baseline image with the t * features_in_step least relevant pixels restored)
    monotonic = all(y_{t+1} - y_t >= 0 for t = 1..T-1)

The baseline is one value per image read from the original image ("black": min, "white": max,
"mean", "uniform": a draw from ``uniform_range`` with ``generator``, or a number). By default
relevance is ranked by ``|map|`` (``absolute=True``) and scores are softmax probabilities, as
in Quantus. Ties are broken by the stable sort (earlier pixel first).

Note on Quantus 0.6.0: its default ``perturb_func`` writes the baseline (read from the
all-baseline image, i.e. the baseline itself) at the revealed indices, so its input never
changes and every explanation comes out monotonic. ``benchmarks/quantus_parity.py`` shows this
and compares against Quantus' loop given a ``perturb_func`` that restores the original values.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch

from .batched_forward import Forward
from .images.pixel_flipping import Baseline, PerturbationCurve, baseline_values, cumulative_logits, target_scores
from .results import ScalarResult
from .tokens.token_flipping import stable_order
from .validation import require_positive_int


class Monotonicity(PerturbationCurve):
    """Share of explanations whose score curve never decreases as pixels are restored by rising relevance.

    ``per_example`` returns one bool per image (Quantus' per-sample output), ``curves`` the
    scores (B, T) behind it; ``compute()`` the fraction of monotonic explanations (higher is
    better) as a ``ScalarResult``. The comparison is exact (``>= 0``): restoring a pixel equal
    to the baseline leaves the input, and so the score, unchanged.

    Cost: every step is one perturbed copy through the model, ``T = ceil(H W / features_in_step)``
    per image; the default ``features_in_step=1`` on a 224 x 224 image is 50,176 forward rows per
    image (as for :class:`~.pixel_flipping.PixelFlipping`). Raise ``features_in_step`` and bound
    the rows per forward call (and the copies held in memory) with ``max_batch_size``.

    Example::

        metric = Monotonicity(model, features_in_step=64, max_batch_size=256)
        metric.update(images, labels, maps)
        metric.compute().value
    """

    def __init__(self, forward: Forward, features_in_step: int = 1, baseline: Baseline = "black",
                 softmax: bool = True, absolute: bool = True,
                 normalize: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 max_batch_size: Optional[int] = None, uniform_range: Tuple[float, float] = (0.0, 1.0),
                 generator: Optional[torch.Generator] = None) -> None:
        super().__init__(forward, baseline, softmax, absolute, normalize, max_batch_size, uniform_range, generator)
        self.features_in_step = require_positive_int("features_in_step", features_in_step)
        self._add_state("monotonic")
        self._add_state("count")

    def curves(self, images: torch.Tensor, labels: torch.Tensor, maps: torch.Tensor) -> torch.Tensor:
        """The scores (B, T), float64, after each step of restoring pixels (T = ceil(H W / features_in_step))."""
        images, labels, maps = self._inputs(images, labels, maps)
        batch, channels = images.shape[:2]
        pixels = images.shape[2] * images.shape[3]
        order = stable_order(maps.reshape(batch, -1), descending=False)
        s = self.features_in_step
        steps = [order[:, t * s:(t + 1) * s] for t in range(math.ceil(pixels / s))]
        value = baseline_values(self.baseline, images, self.uniform_range, self.generator)
        start = value.reshape(batch, 1, 1, 1).expand(images.shape).clone()
        original = images.reshape(batch, channels, -1)

        def restore(current: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
            index = indices.to(original.device)[:, None, :].expand(batch, channels, indices.shape[1])
            return original.gather(2, index)

        logits = cumulative_logits(self.forward, start, steps, restore, self.normalize, self.max_batch_size,
                                   labels=labels)
        return target_scores(logits, labels, self.softmax).T.cpu()

    def per_example(self, images: torch.Tensor, labels: torch.Tensor, maps: torch.Tensor) -> torch.Tensor:
        """One bool per image: True iff its curve never decreases."""
        return (torch.diff(self.curves(images, labels, maps), dim=1) >= 0).all(dim=1)

    def update(self, images: torch.Tensor, labels: torch.Tensor, maps: torch.Tensor) -> None:
        """Add a batch: images (B, C, H, W) as the model reads them (before ``normalize``),
        labels (B,) the explained classes, maps (B, H, W) / (B, 1|C, H, W)."""
        monotonic = self.per_example(images, labels, maps)
        self._add("monotonic", monotonic.sum())
        self._add("count", torch.tensor(monotonic.shape[0]))

    def compute(self) -> ScalarResult:
        """The fraction of monotonic explanations (NaN before any update, never a silent 0)."""
        count = int(self._state["count"].item())
        value = float(self._state["monotonic"].item()) / count if count else float("nan")
        return ScalarResult("monotonicity", value, count)

