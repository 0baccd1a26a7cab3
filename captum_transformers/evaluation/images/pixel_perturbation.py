"""Positive / negative pixel perturbation curves (Chefer et al., CVPR 2021, Sec. 4 and their
evaluation code), under a named protocol of removed fractions."""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple, Union

import torch

from ...errors import InputError
from ..accumulator import Accumulator
from ..batched_forward import Forward, check_max_batch_size, logits_per_step
from ..curves import mean_curve
from ..results import CurveResult
from .saliency_maps import image_batch, minmax_normalize
from ..validation import require_choice, require_fractions

CVPR21_PIXEL_FRACTIONS: Tuple[float, ...] = tuple(i / 10 for i in range(10))
"""0.0, 0.1, ..., 0.9: the removed fractions of the authors' code (the clean image included)."""

FINE_PIXEL_FRACTIONS: Tuple[float, ...] = (tuple(i / 100 for i in range(10))
                                           + tuple(i / 10 for i in range(1, 10)))
"""0.0, 0.01, ..., 0.09, then 0.1, 0.2, ..., 0.9 (19 steps): the default. On small images a
faithful map takes the object out within the first 10 % of pixels, so the authors' first step
already lands at the bottom and their AUC mostly measures that one step; the 1 % steps
resolve where the curve falls. Same range as the CVPR'21 steps, so the AUCs share a scale."""

PIXEL_PROTOCOLS: Dict[str, Tuple[float, ...]] = {"fine": FINE_PIXEL_FRACTIONS, "cvpr21": CVPR21_PIXEL_FRACTIONS}
"""Named fraction protocols for ``PixelPerturbation(fractions=NAME)`` and the benchmark CLI."""

PIXEL_FRACTIONS: Tuple[float, ...] = FINE_PIXEL_FRACTIONS
"""The default fractions (the ``"fine"`` protocol)."""


def pixel_fractions(fractions: Union[str, Sequence[float]]) -> Tuple[float, ...]:
    """A protocol name of ``PIXEL_PROTOCOLS`` or explicit fractions, as checked fractions.

    >>> pixel_fractions("cvpr21")[:3]
    (0.0, 0.1, 0.2)
    """
    if isinstance(fractions, str):
        if fractions not in PIXEL_PROTOCOLS:
            raise InputError(f"fractions={fractions!r} names no pixel perturbation protocol; expected one of "
                             f"{tuple(PIXEL_PROTOCOLS)} or a strictly increasing sequence of fractions in [0, 1].")
        return PIXEL_PROTOCOLS[fractions]
    return require_fractions(fractions, 0.0, 1.0)


class PixelPerturbation(Accumulator):
    """Top-1 accuracy as the most (``"positive"``) or least (``"negative"``) relevant pixels are removed.

    For each image and each fraction ``f`` the map is min-max normalised, the ``int(H * W * f)``
    pixels ranked highest by ``torch.topk`` (of the map for ``"positive"``, of ``-map`` for
    ``"negative"``) are set to 0 in every channel of the [0, 1] image, the result goes through
    ``normalize`` and the model, and ``argmax(logits) == label`` is recorded.

        curve(f) = mean over images of 1[argmax forward(normalize(x_f)) == label]
        AUC = 100 * trapezoid(curve, fractions)

    ``fractions`` is a protocol name, ``"fine"`` (default, ``FINE_PIXEL_FRACTIONS``: 1 % steps
    to 10 %, then 10 % steps to 90 %) or ``"cvpr21"`` (``CVPR21_PIXEL_FRACTIONS``: the
    authors' 0, 0.1, ..., 0.9), or explicit increasing fractions. The trapezoid runs over the
    actual fractions, so uneven steps weigh each segment by its width; both protocols span
    [0, 0.9], so a curve that never leaves 1 has AUC 90 under either.

    Lower positive AUC and higher negative AUC mean a more faithful map. Ties among equal
    map values are broken as ``torch.topk`` breaks them (implementation-defined, in practice
    deterministic on one device); maps with many ties (e.g. constant regions) therefore depend
    on it. Accuracy is always against ``labels``; which class the maps explain is the caller's
    choice.

    Example::

        metric = PixelPerturbation(model, mode="positive", normalize=imagenet_normalize)  # or fractions="cvpr21"
        for images, labels in loader:
            metric.update(images, labels, explain(images))
        metric.compute().auc
    """

    def __init__(
        self,
        forward: Forward,
        mode: str = "positive",
        fractions: Union[str, Sequence[float]] = "fine",
        normalize: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        max_batch_size: Optional[int] = None,
    ) -> None:
        super().__init__()
        require_choice("mode", mode, ("positive", "negative"))
        self.forward = forward
        self.mode = mode
        self.fractions = pixel_fractions(fractions)
        self.normalize = normalize if normalize is not None else (lambda images: images)
        self.max_batch_size = check_max_batch_size(max_batch_size)
        self._add_state("correct", (len(self.fractions),))
        self._add_state("count")

    def update(self, images: torch.Tensor, labels: torch.Tensor, maps: torch.Tensor) -> None:
        """Add a batch: images (B, C, H, W) in [0, 1], labels (B,), maps (B, H, W) / (B, 1|C, H, W)."""
        images, labels, maps = image_batch(images, labels, maps)
        batch, channels, height, width = images.shape
        order = minmax_normalize(maps).reshape(batch, -1)
        if self.mode == "negative":
            order = -order
        counts = [int(height * width * f) for f in self.fractions]

        def build(steps):
            perturbed = []
            for step in steps:
                keep = torch.ones(batch, height * width, dtype=images.dtype, device=images.device)
                top = torch.topk(order, counts[step], dim=1).indices.to(images.device)
                keep.scatter_(1, top, 0.0)
                perturbed.append(self.normalize(images * keep.reshape(batch, 1, height, width)))
            return torch.cat(perturbed)

        logits = logits_per_step(self.forward, build, len(counts), batch, self.max_batch_size, labels=labels)
        correct = logits.argmax(dim=-1).cpu() == labels.cpu()
        self._add("correct", correct.sum(dim=1))
        self._add("count", torch.tensor(batch))

    def compute(self) -> CurveResult:
        return mean_curve(
            f"perturbation_{self.mode}", self.fractions, self._state["correct"], self._state["count"],
            auc_scale=100.0, higher_is_better=self.mode == "negative", y_label="top-1 accuracy",
            x_label="fraction of pixels removed",
        )
