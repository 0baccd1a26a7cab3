"""What removed pixels of an image become (the occlusion strategy), and relevance pooled over patches.

Blücher et al. (TMLR 2024) show that MIF and LIF rankings depend on this choice; RISE
(Petsiuk et al., BMVC 2018) deletes to zero and inserts into a blurred copy. The choices:

* ``"zero"``: 0 in every channel (black for images in [0, 1]);
* ``"mean"``: the image's own mean per channel;
* ``"blur"``: the image blurred by RISE's Gaussian (11 x 11 kernel, sigma 5, zero padding);
* a number: that constant in every channel;
* a callable ``images (B, C, H, W) -> fill (B, C, H, W)``.
"""
from __future__ import annotations

import math
from numbers import Real
from typing import Callable, Union

import torch

from ..errors import InputError

Occlusion = Union[str, float, Callable[[torch.Tensor], torch.Tensor]]

OCCLUSIONS = ("zero", "mean", "blur")
"""Named occlusion strategies; a number or a callable are accepted too."""


def check_occlusion(occlusion: Occlusion) -> Occlusion:
    """Return ``occlusion`` if it is a named strategy, a finite number or a callable."""
    if callable(occlusion) or occlusion in OCCLUSIONS:
        return occlusion
    if isinstance(occlusion, Real) and not isinstance(occlusion, bool) and math.isfinite(occlusion):
        return float(occlusion)
    raise InputError(f"occlusion={occlusion!r} is not one of {OCCLUSIONS}, a finite number or a callable "
                     "images -> fill of the same shape. Pick one of those.")


def gaussian_blur(images: torch.Tensor, kernel_size: int = 11, sigma: float = 5.0) -> torch.Tensor:
    """Each channel convolved with a normalised ``kernel_size``-square Gaussian, zero padded (as RISE's code).

    >>> round(gaussian_blur(torch.ones(1, 1, 21, 21))[0, 0, 10, 10].item(), 5)   # the centre sees the whole kernel
    1.0
    """
    offsets = torch.arange(kernel_size, dtype=torch.float64) - (kernel_size - 1) / 2
    line = torch.exp(-offsets ** 2 / (2 * sigma ** 2))
    kernel = torch.outer(line, line)
    kernel = (kernel / kernel.sum()).to(device=images.device, dtype=images.dtype)
    channels = images.shape[1]
    weight = kernel.expand(channels, 1, kernel_size, kernel_size)
    return torch.nn.functional.conv2d(images, weight, padding=kernel_size // 2, groups=channels)


def occlusion_fill(images: torch.Tensor, occlusion: Occlusion) -> torch.Tensor:
    """The values removed pixels take, (B, C, H, W) like ``images``.

    >>> occlusion_fill(torch.tensor([[[[0.0, 1.0]]]]), "mean").tolist()
    [[[[0.5, 0.5]]]]
    """
    if callable(occlusion):
        fill = occlusion(images)
        if not isinstance(fill, torch.Tensor) or fill.shape != images.shape:
            raise InputError(
                f"The occlusion callable returned {tuple(fill.shape) if isinstance(fill, torch.Tensor) else type(fill)}"
                f" for images of shape {tuple(images.shape)}; it must return a tensor of the same shape."
            )
        return fill.to(images.dtype)
    if occlusion == "zero":
        return torch.zeros_like(images)
    if occlusion == "mean":
        return images.mean(dim=(2, 3), keepdim=True).expand_as(images)
    if occlusion == "blur":
        return gaussian_blur(images)
    return torch.full_like(images, float(occlusion))


def patch_relevance(maps: torch.Tensor, patch_size: int) -> torch.Tensor:
    """Pixel maps (B, H, W) summed over ``patch_size``-square patches, flattened to (B, H/p * W/p).

    The sum keeps the total relevance (conservative maps stay conservative per patch).

    >>> patch_relevance(torch.arange(16.0).reshape(1, 4, 4), 2).tolist()
    [[10.0, 18.0, 42.0, 50.0]]
    """
    batch, height, width = maps.shape
    if height % patch_size or width % patch_size:
        raise InputError(f"patch_size={patch_size} does not divide the image size {(height, width)}; pick a patch "
                         "size that divides both sides (e.g. the model's patch size).")
    patches = maps.reshape(batch, height // patch_size, patch_size, width // patch_size, patch_size)
    return patches.sum(dim=(2, 4)).reshape(batch, -1)


def patch_pixels(removed: torch.Tensor, patch_size: int, height: int, width: int) -> torch.Tensor:
    """Per-patch flags (B, N) as per-pixel flags (B, 1, H, W)."""
    grid = removed.reshape(removed.shape[0], 1, height // patch_size, width // patch_size)
    return grid.repeat_interleave(patch_size, dim=2).repeat_interleave(patch_size, dim=3)
