"""MIF / LIF curves and SRG over the pixels or patches of images (Blücher et al., TMLR 2024).

See :mod:`relevance_gain` for the curves, the score and the area difference, and
:mod:`image_occlusion` for what removed pixels become.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ...errors import InputError
from ..batched_forward import Forward, check_max_batch_size, logits_per_step
from .occlusion import Occlusion, check_occlusion, occlusion_fill, patch_pixels, patch_relevance
from ..relevance_gain import GAIN_FRACTIONS, RelevanceGain, removal_masks
from .saliency_maps import image_batch


class ImageRelevanceGain(RelevanceGain):
    """MIF and LIF curves of the explained class's score as pixels (or patches) are occluded; SRG.

    Features are ``patch_size``-square patches (1: single pixels), ranked by the map summed
    over each patch. Step ``x_t`` replaces the ``ceil(x_t * n)`` most (MIF) or least (LIF)
    relevant patches of every channel by the ``occlusion`` fill (``"zero"``, ``"mean"``
    (default: the image's own channel means), ``"blur"``, a constant or a callable), then
    ``normalize`` and the model run on the result. Occlusion acts on the images as given
    (e.g. [0, 1] pixels), before ``normalize``.

        SRG = trapezoid(mean LIF curve) - trapezoid(mean MIF curve)    (higher is better)

    The curves track ``labels``' class: pass the class the maps explain (e.g. the predicted
    one). All 2T perturbed copies of a batch go through ``logits_per_step`` (one forward call
    unless ``max_batch_size`` splits it).

    Example::

        metric = ImageRelevanceGain(model, patch_size=16, occlusion="mean", normalize=imagenet_normalize)
        for images, labels in loader:
            metric.update(images, labels, explain(images))
        metric.compute().srg
    """

    name = "srg_image"

    def __init__(
        self,
        forward: Forward,
        fractions: Sequence[float] = GAIN_FRACTIONS,
        occlusion: Occlusion = "mean",
        patch_size: int = 1,
        score: str = "prob",
        normalize: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        max_batch_size: Optional[int] = None,
    ) -> None:
        super().__init__(fractions, score)
        if not isinstance(patch_size, int) or isinstance(patch_size, bool) or patch_size < 1:
            raise InputError(f"patch_size={patch_size!r} must be a positive int (1 for single pixels).")
        self.forward = forward
        self.occlusion = check_occlusion(occlusion)
        self.patch_size = patch_size
        self.normalize = normalize if normalize is not None else (lambda images: images)
        self.max_batch_size = check_max_batch_size(max_batch_size)

    def update(self, images: torch.Tensor, labels: torch.Tensor, maps: torch.Tensor) -> None:
        """Add a batch: images (B, C, H, W), labels (B,), maps (B, H, W) / (B, 1|C, H, W)."""
        images, labels, maps = image_batch(images, labels, maps)
        batch, channels, height, width = images.shape
        relevance = patch_relevance(maps, self.patch_size)
        removed = removal_masks(relevance, torch.ones_like(relevance, dtype=torch.bool), self.fractions)
        removed = removed.to(images.device)
        fill = occlusion_fill(images, self.occlusion)

        def build(steps):
            return torch.cat([
                self.normalize(torch.where(patch_pixels(removed[s], self.patch_size, height, width), fill, images))
                for s in steps
            ])

        logits = logits_per_step(self.forward, build, removed.shape[0], batch, self.max_batch_size, labels=labels)
        self._record(logits, labels)
