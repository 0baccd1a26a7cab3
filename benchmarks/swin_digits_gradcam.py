"""pytorch-grad-cam's standard Swin recipe on the DigitCanvas Swin, scored like the package's rows.

pytorch-grad-cam (``pip install grad-cam``; a benchmark comparison, not a dependency of the
package) explains Swin with Grad-CAM on the last block's first LayerNorm and a
``reshape_transform`` that turns its tokens into a feature map (the recipe of its
``swinT_example.py``: ``target_layers = [model.layers[-1].blocks[-1].norm1]``; timm >= 0.9
blocks take ``(B, H, W, C)`` already, so the transform is a permute to ``(B, C, H, W)``).
Its maps are scored on exactly the canvases, metrics and settings of
``captum-transformers benchmark --task digits-swin`` and ``--task digits-two-swin``
(predicted class; fine pixel steps; segmentation; two-digit class specificity).

Run: ``OMP_NUM_THREADS=1 python benchmarks/swin_digits_gradcam.py [--limit N] [--batch-size 32]``.
"""
from __future__ import annotations

import argparse
import time

import torch

from captum_transformers.evaluation import ClassSpecificity, PixelPerturbation, SegmentationScores
from captum_transformers.tasks.digits.canvas import digit_canvases, normalize
from captum_transformers.tasks.digits.swin import load_digit_swin


def grad_cam_maps(model, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """pytorch-grad-cam's GradCAM maps (B, H, W) for the given classes."""
    from pytorch_grad_cam import GradCAM
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    with GradCAM(model=model, target_layers=[model.layers[-1].blocks[-1].norm1],
                 reshape_transform=lambda tensor: tensor.permute(0, 3, 1, 2)) as cam:
        maps = cam(input_tensor=inputs, targets=[ClassifierOutputTarget(int(t)) for t in targets])
    return torch.as_tensor(maps, dtype=torch.float64)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    model = load_digit_swin()
    forward = lambda images: model(images)  # noqa: E731
    data = digit_canvases(split="test", variant="one", n=args.limit, seed=0)
    positive = PixelPerturbation(forward, "positive", fractions="fine", normalize=normalize)
    negative = PixelPerturbation(forward, "negative", fractions="fine", normalize=normalize)
    segmentation = SegmentationScores()
    for first in range(0, len(data), args.batch_size):
        chunk = slice(first, first + args.batch_size)
        images, labels, masks = data.images[chunk], data.labels[chunk], data.masks[chunk]
        inputs = normalize(images)
        with torch.no_grad():
            predicted = model(inputs).argmax(-1)
        maps = grad_cam_maps(model, inputs, predicted)
        positive.update(images, labels, maps)
        negative.update(images, labels, maps)
        segmentation.update(maps, masks)
    seg = segmentation.compute()
    print(f"digits-swin, {len(data)} canvases: positive AUC {positive.compute().auc:.1f}, negative AUC "
          f"{negative.compute().auc:.1f}, pixel accuracy {seg.pixel_accuracy:.3f}, mIoU {seg.miou:.3f}, "
          f"mAP {seg.mean_ap:.3f}")
    two = digit_canvases(split="test", variant="two", n=args.limit, seed=0)
    specificity = ClassSpecificity()
    for first in range(0, len(two), args.batch_size):
        chunk = slice(first, first + args.batch_size)
        inputs, labels, masks = normalize(two.images[chunk]), two.labels[chunk], two.masks[chunk]
        maps_a = grad_cam_maps(model, inputs, labels[:, 0])
        maps_b = grad_cam_maps(model, inputs, labels[:, 1])
        specificity.update(maps_a, maps_b, masks[:, 0], masks[:, 1])
    print(f"digits-two-swin, {len(two)} canvases: class-specific share {specificity.compute().specificity:.3f} "
          f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
