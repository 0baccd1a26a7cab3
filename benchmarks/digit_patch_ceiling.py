"""How high can any patch-level map score on DigitCanvas segmentation?

Every attention method (raw attention, rollout, Grad-CAM, GenericAttention,
TransformerRelevance) scores the built-in ViT's 8 x 8 patch tokens, and the benchmark
upsamples those 64 numbers bilinearly to the 32 x 32 canvas before the CVPR'21 protocol
(per-image min-max, foreground = above the mean, mIoU from summed counts). This script
builds *oracle* patch maps from the ground-truth masks themselves and scores them by the
same protocol, so their mIoU bounds what any patch-level explanation can reach:

* ``fraction``: each patch scored by the fraction of its pixels on the digit;
* ``fraction^p``: the same, sharpened;
* ``binary, threshold t``: 1 on patches whose fraction exceeds ``t`` (best ``t`` over a grid);
* ``binary, best t per image``: for each canvas the threshold with the best IoU sum;
* ``binary, greedy per image``: from there, single-patch flips kept while they raise the
  canvas's IoU sum (a local search over the 2^64 binary patch maps of each canvas).

These are oracles, not a proof of a bound: a cleverer patch map might score a little higher.

Usage::

    python benchmarks/digit_patch_ceiling.py            # the 360 test canvases
    python benchmarks/digit_patch_ceiling.py --json ceiling.json
"""
from __future__ import annotations

import argparse
import json
from typing import Dict

import torch
import torch.nn.functional as F

from captum_transformers.evaluation import SegmentationScores
from captum_transformers.tasks.digits.canvas import digit_canvases

PATCH = 4  # the built-in model's patch size (fixed by the task)
THRESHOLDS = tuple(round(0.05 * i, 2) for i in range(20))


def _upsample(patch_maps: torch.Tensor, size) -> torch.Tensor:
    """(B, gh, gw) patch scores onto pixels, as the methods map tokens onto an image."""
    return F.interpolate(patch_maps[:, None], size=size, mode="bilinear", align_corners=False)[:, 0]


def _miou(maps: torch.Tensor, masks: torch.Tensor) -> float:
    scores = SegmentationScores()
    scores.update(maps, masks)
    return scores.compute().miou


def _per_image_iou_sum(maps: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Foreground + background IoU of each image under the protocol's threshold."""
    low, high = maps.amin((1, 2), keepdim=True), maps.amax((1, 2), keepdim=True)
    normalized = (maps - low) / (high - low).clamp_min(1e-12)
    foreground = normalized > normalized.mean((1, 2), keepdim=True)
    truth = masks != 0
    iou = lambda a, b: (a & b).sum((1, 2)) / (a | b).sum((1, 2)).clamp_min(1)  # noqa: E731
    return iou(foreground, truth) + iou(~foreground, ~truth)


def patch_ceilings(split: str = "test") -> Dict[str, float]:
    """mIoU of oracle patch maps built from the ground-truth masks of ``split``."""
    data = digit_canvases(split, "one")
    masks = data.masks
    size = masks.shape[-2:]
    fraction = F.avg_pool2d(masks[:, None].to(torch.float64), PATCH)[:, 0]
    results = {"fraction": _miou(_upsample(fraction, size), masks)}
    for power in (2, 3, 4):
        results[f"fraction^{power}"] = _miou(_upsample(fraction ** power, size), masks)
    binary = {t: _upsample((fraction > t).to(torch.float64), size) for t in THRESHOLDS}
    best_t = max(THRESHOLDS, key=lambda t: _miou(binary[t], masks))
    results[f"binary, threshold {best_t}"] = _miou(binary[best_t], masks)
    per_image = torch.stack([_per_image_iou_sum(binary[t], masks) for t in THRESHOLDS])
    chosen = torch.stack([binary[t] for t in THRESHOLDS])[per_image.argmax(0), torch.arange(masks.shape[0])]
    results["binary, best t per image"] = _miou(chosen, masks)
    start = torch.stack([(fraction > t) for t in THRESHOLDS])[per_image.argmax(0), torch.arange(masks.shape[0])]
    results["binary, greedy per image"] = _miou(_upsample(_greedy_flips(start, masks), size), masks)
    return results


def _greedy_flips(patches: torch.Tensor, masks: torch.Tensor, rounds: int = 10) -> torch.Tensor:
    """Local search per image: flip one patch of the binary patch map at a time (all
    images at once) and keep the flip where it raises that image's IoU sum."""
    patches = patches.clone()
    size = masks.shape[-2:]
    best = _per_image_iou_sum(_upsample(patches.to(torch.float64), size), masks)
    for _ in range(rounds):
        improved = False
        for index in range(patches[0].numel()):
            row, col = divmod(index, patches.shape[-1])
            trial = patches.clone()
            trial[:, row, col] = ~trial[:, row, col]
            score = _per_image_iou_sum(_upsample(trial.to(torch.float64), size), masks)
            better = score > best
            if better.any():
                patches[better] = trial[better]
                best = torch.where(better, score, best)
                improved = True
        if not improved:
            break
    return patches.to(torch.float64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split", default="test", choices=("train", "val", "test"))
    parser.add_argument("--json", metavar="PATH", help="also write the ceilings as JSON")
    args = parser.parse_args()
    ceilings = patch_ceilings(args.split)
    print(f"DigitCanvas {args.split} canvases, oracle patch maps ({PATCH}x{PATCH}-pixel patches), CVPR'21 protocol:")
    for name, miou in ceilings.items():
        print(f"  {name:<28} mIoU {miou:.3f}")
    print(f"  best of these                mIoU {max(ceilings.values()):.3f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(ceilings, handle, indent=2)


if __name__ == "__main__":
    main()
