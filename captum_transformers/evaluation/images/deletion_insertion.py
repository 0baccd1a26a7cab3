"""Deletion and insertion curves of pixel saliency (Petsiuk, Das and Saenko, "RISE: Randomized
input sampling for explanation of black-box models", BMVC 2018, Sec. 4.1 and their code).

* :class:`RiseDeletion`: remove pixels most relevant first, replacing them by a baseline
  (``"zero"`` by default, as RISE); the explained class's probability should fall fast
  (lower AUC is better).
* :class:`RiseInsertion`: start from a blurred canvas (RISE's Gaussian, 11 x 11, sigma 5)
  and insert the original pixels most relevant first; the probability should rise fast
  (higher AUC is better).

With ``x_t`` the fraction of pixels deleted (inserted) and ``p_t`` the softmax probability
of ``labels``' class::

    curve(x_t) = mean over images of p_t,      AUC = trapezoid(curve, x)  (x in [0, 1])

Step ``x_t`` changes the ``ceil(x_t * H * W)`` highest-ranked pixels (all channels; ties:
earlier pixel in row-major order first). RISE's code changes a fixed number of pixels per
step (224 of 224 x 224) and takes the same trapezoid; the default 51 steps of 2 % each keep
the cost at 51 forward copies per image. Deletion and insertion act on the images as given
(e.g. [0, 1]), before ``normalize``.

Example::

    deletion, insertion = RiseDeletion(model, normalize=norm), RiseInsertion(model, normalize=norm)
    for images, labels in loader:
        maps = explain(images)
        deletion.update(images, labels, maps)
        insertion.update(images, labels, maps)
    deletion.compute().auc, insertion.compute().auc
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch

from ..accumulator import Accumulator, exact_sum
from ..batched_forward import Forward, check_max_batch_size, logits_per_step
from ..curves import mean_curve
from .occlusion import Occlusion, check_occlusion, occlusion_fill
from ..relevance_gain import GAIN_SCORES, class_scores
from ..results import CurveResult
from .saliency_maps import image_batch
from ..tokens.token_flipping import flip_counts, ranks
from ..validation import require_choice, require_fractions

RISE_FRACTIONS: Tuple[float, ...] = tuple(i / 50 for i in range(51))
"""0.0, 0.02, ..., 1.0: the fractions of pixels deleted or inserted (51 steps, both ends included)."""


class _RiseCurve(Accumulator):
    """Shared: rank pixels, build every step's image in one stacked forward, sum class scores exactly."""

    name = ""
    inserting = False

    def __init__(self, forward: Forward, fractions: Sequence[float], fill: Occlusion, score: str,
                 normalize: Optional[Callable[[torch.Tensor], torch.Tensor]], max_batch_size: Optional[int]) -> None:
        super().__init__()
        require_choice("score", score, GAIN_SCORES)
        self.forward = forward
        self.fractions = require_fractions(fractions, 0.0, 1.0)
        self.fill = check_occlusion(fill)
        self.score = score
        self.normalize = normalize if normalize is not None else (lambda images: images)
        self.max_batch_size = check_max_batch_size(max_batch_size)
        self._add_state("sums", (len(self.fractions),), exact=True)
        self._add_state("count")

    def update(self, images: torch.Tensor, labels: torch.Tensor, maps: torch.Tensor) -> None:
        """Add a batch: images (B, C, H, W), labels (B,) (the explained classes), maps (B, H, W) / (B, 1|C, H, W)."""
        images, labels, maps = image_batch(images, labels, maps)
        batch, channels, height, width = images.shape
        order = ranks(maps.reshape(batch, -1), descending=True).to(images.device)
        counts = flip_counts(self.fractions, torch.ones_like(order, dtype=torch.bool)).to(images.device)
        fill = occlusion_fill(images, self.fill)
        start, end = (fill, images) if self.inserting else (images, fill)

        def build(steps):
            changed = [(order < counts[s][:, None]).reshape(batch, 1, height, width) for s in steps]
            return torch.cat([self.normalize(torch.where(c, end, start)) for c in changed])

        logits = logits_per_step(self.forward, build, len(self.fractions), batch, self.max_batch_size, labels=labels)
        self._add("sums", exact_sum(class_scores(logits, labels, self.score).cpu(), dim=1))
        self._add("count", torch.tensor(batch))

    def compute(self) -> CurveResult:
        verb = "inserted" if self.inserting else "deleted"
        return mean_curve(self.name, self.fractions, self._value("sums"), self._state["count"],
                          higher_is_better=self.inserting, y_label=f"{self.score} of the explained class",
                          x_label=f"fraction of pixels {verb}")


class RiseDeletion(_RiseCurve):
    """RISE deletion: pixels most relevant first become ``baseline`` (default ``"zero"``); lower AUC is better.

    ``baseline`` takes the occlusion choices of :mod:`image_occlusion` (``"zero"``,
    ``"mean"``, ``"blur"``, a constant, a callable); ``score`` is ``"prob"`` (RISE),
    ``"logit"`` or ``"log_prob"`` of ``labels``' class.
    """

    name = "deletion"
    inserting = False

    def __init__(self, forward: Forward, fractions: Sequence[float] = RISE_FRACTIONS, baseline: Occlusion = "zero",
                 score: str = "prob", normalize: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 max_batch_size: Optional[int] = None) -> None:
        super().__init__(forward, fractions, baseline, score, normalize, max_batch_size)


class RiseInsertion(_RiseCurve):
    """RISE insertion: pixels most relevant first go back into ``canvas`` (default ``"blur"``); higher AUC is better.

    ``canvas`` takes the occlusion choices of :mod:`image_occlusion`; ``score`` as in
    :class:`RiseDeletion`.
    """

    name = "insertion"
    inserting = True

    def __init__(self, forward: Forward, fractions: Sequence[float] = RISE_FRACTIONS, canvas: Occlusion = "blur",
                 score: str = "prob", normalize: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 max_batch_size: Optional[int] = None) -> None:
        super().__init__(forward, fractions, canvas, score, normalize, max_batch_size)
