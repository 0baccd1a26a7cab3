"""Segmentation scores of saliency maps against object masks (Chefer et al., CVPR 2021,
ImageNet-segmentation evaluation)."""
from __future__ import annotations

import torch

from ..accumulator import Accumulator, exact_sum
from ..average_precision import average_precision
from ..results import SegmentationResult
from .saliency_maps import minmax_normalize
from ..validation import require_finite, require_nonempty_batch, require_same_shape, require_tensor

_EPS = float(torch.finfo(torch.float64).eps)


class SegmentationScores(Accumulator):
    """Pixel accuracy, mIoU and mAP of thresholded saliency maps as foreground masks.

    Per image the map is min-max normalised and ``pixel > mean(map)`` is predicted foreground.
    Over the whole dataset (counts summed before dividing, as in the authors' code)::

        pixAcc = sum correct pixels / sum labelled pixels
        IoU_c  = sum |pred_c & gt_c| / (eps + sum |pred_c | gt_c|),   c in {background, foreground}
        mIoU   = (IoU_background + IoU_foreground) / 2

    with ``eps`` the float64 machine epsilon (the authors' ``np.spacing(1)``), and

        mAP = mean over images of AP([1 - map, map], [1 - mask, mask])

    where each image's 2 * H * W (score, label) pairs of both classes are pooled into one
    average precision (``sklearn.metrics.average_precision_score(labels.ravel(), scores.ravel())``).
    NaN or infinite maps (or masks) and empty batches are refused with an ``InputError``.

    Example::

        metric = SegmentationScores()
        metric.update(maps, masks)          # (B, H, W) each
        metric.compute().miou
    """

    def __init__(self) -> None:
        super().__init__()
        self._add_state("intersection", (2,))
        self._add_state("union", (2,))
        self._add_state("correct")
        self._add_state("labelled")
        self._add_state("ap_sum", exact=True)
        self._add_state("count")

    def update(self, maps: torch.Tensor, masks: torch.Tensor) -> None:
        """Add a batch of maps (B, H, W) and binary masks (B, H, W) (bool or 0/1; nonzero = object).

        Refuses NaN or infinite maps or masks (no threshold or ranking of them) and an empty batch, like the
        other metrics.
        """
        maps = require_tensor("maps", maps, ndim=(3,)).detach().to(torch.float64)
        masks = require_tensor("masks", masks, ndim=(3,))
        require_same_shape(("maps", "masks"), (maps, masks))
        require_nonempty_batch(maps.shape[0])
        require_finite("maps", maps)
        require_finite("masks", masks)
        normalized = minmax_normalize(maps)
        foreground = normalized > normalized.mean(dim=(1, 2), keepdim=True)
        truth = masks != 0
        predicted = torch.stack([~foreground, foreground])
        target = torch.stack([~truth, truth])
        self._add("intersection", (predicted & target).sum(dim=(1, 2, 3)))
        self._add("union", (predicted | target).sum(dim=(1, 2, 3)))
        self._add("correct", (foreground == truth).sum())
        self._add("labelled", torch.tensor(truth.numel()))
        batch = maps.shape[0]
        scores = torch.cat([1.0 - normalized, normalized], dim=1).reshape(batch, -1)
        labels = torch.cat([~truth, truth], dim=1).reshape(batch, -1)
        self._add("ap_sum", exact_sum(average_precision(scores, labels)))
        self._add("count", torch.tensor(batch))

    def compute(self) -> SegmentationResult:
        state = self._state
        iou = state["intersection"] / (_EPS + state["union"])
        count = int(state["count"].item())
        nan = float("nan")
        return SegmentationResult(
            name="segmentation",
            pixel_accuracy=float(state["correct"] / state["labelled"]) if count else nan,
            iou_background=float(iou[0]) if count else nan,
            iou_foreground=float(iou[1]) if count else nan,
            miou=float(iou.mean()) if count else nan,
            mean_ap=float(self._value("ap_sum")) / count if count else nan,
            count=count,
        )
