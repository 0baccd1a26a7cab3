"""Pixel saliency maps as the image metrics read them: one (H, W) map per image, min-max
normalised per image."""
from __future__ import annotations

from typing import Optional

import torch

from ...errors import InputError
from ..validation import require_finite, require_labels, require_tensor


def as_pixel_maps(maps: torch.Tensor, height: int, width: int, channels: Optional[int] = None,
                  name: str = "maps") -> torch.Tensor:
    """Return maps as (B, H, W) float64.

    Accepted: (B, H, W); (B, 1, H, W); (B, C, H, W) with one map per image channel, which is
    reduced by a **sum over channels** (the channel-wise relevance of Gradient x Input or LRP
    adds up to the pixel's relevance).

    >>> as_pixel_maps(torch.ones(2, 3, 4, 5), 4, 5, channels=3)[0, 0, 0]
    tensor(3., dtype=torch.float64)
    """
    maps = require_tensor(name, maps, ndim=(3, 4))
    if maps.dim() == 4:
        if maps.shape[1] != 1 and maps.shape[1] != channels:
            raise InputError(
                f"{name} has shape {tuple(maps.shape)}: {maps.shape[1]} channels, but maps must have 1 channel or "
                f"one per image channel ({channels}). Pass (B, H, W) maps."
            )
        maps = maps.sum(dim=1)
    if tuple(maps.shape[1:]) != (height, width):
        raise InputError(
            f"{name} has spatial size {tuple(maps.shape[1:])} but the images are {(height, width)}. Upsample the maps "
            "to the image size (e.g. torch.nn.functional.interpolate(..., mode='bilinear')) first."
        )
    return maps.detach().to(torch.float64)


def pixel_maps_per_image(maps: torch.Tensor, images: torch.Tensor, name: str = "maps") -> torch.Tensor:
    """One finite (H, W) map per image of ``images`` (B, C, H, W), as (B, H, W) float64 (:func:`as_pixel_maps`).

    Refuses a different number of maps than images, and NaN or infinite maps (no ranking of them).

    >>> pixel_maps_per_image(torch.ones(2, 1, 4, 5), torch.zeros(2, 3, 4, 5)).shape
    torch.Size([2, 4, 5])
    """
    batch, channels, height, width = images.shape
    maps = as_pixel_maps(maps, height, width, channels, name=name)
    if maps.shape[0] != batch:
        raise InputError(f"{name} hold {maps.shape[0]} maps for {batch} images. Pass one map per image.")
    require_finite(name, maps)
    return maps


def minmax_normalize(maps: torch.Tensor) -> torch.Tensor:
    """Per-map ``(m - min m) / (max m - min m)`` over all but the batch dim.

    A constant map (max == min) becomes all zeros instead of 0/0 = NaN.

    >>> minmax_normalize(torch.tensor([[1.0, 3.0, 2.0], [5.0, 5.0, 5.0]]))
    tensor([[0.0000, 1.0000, 0.5000],
            [0.0000, 0.0000, 0.0000]])
    """
    flat = maps.reshape(maps.shape[0], -1)
    low = flat.min(dim=1, keepdim=True).values
    span = flat.max(dim=1, keepdim=True).values - low
    safe_span = torch.where(span > 0, span, torch.ones_like(span))
    return ((flat - low) / safe_span).reshape(maps.shape)


def image_batch(images: torch.Tensor, labels, maps: torch.Tensor):
    """``(images, labels, maps)`` of an image metric's batch, checked: images (B, C, H, W), labels
    (B,), and the maps as one (B, H, W) map per image (:func:`pixel_maps_per_image`)."""
    images = require_tensor("images", images, ndim=(4,))
    labels = require_labels(labels, images.shape[0])
    return images, labels, pixel_maps_per_image(maps, images)
