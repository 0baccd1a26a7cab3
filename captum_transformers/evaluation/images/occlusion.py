"""What removed pixels of an image become (the occlusion strategy), and relevance pooled over patches.

Blücher et al. (TMLR 2024) show that MIF and LIF rankings depend on this choice; RISE
(Petsiuk et al., BMVC 2018) deletes to zero and inserts into a blurred copy. The choices:

* ``"zero"``: 0 in every channel (black for images in [0, 1]);
* ``"mean"``: the image's own mean per channel;
* ``"blur"``: the image blurred by RISE's kernel (``gkern(11, 5)``: an 11 x 11 impulse through
  scipy's reflected Gaussian filter of sigma 5, built here without scipy), zero padded;
* a number: that constant in every channel;
* a callable ``images (B, C, H, W) -> fill (B, C, H, W)``.
"""
from __future__ import annotations

import math
from numbers import Real
from typing import Callable, Union

import torch

from ...errors import InputError

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


def rise_kernel_line(kernel_size: int = 11, sigma: float = 5.0, truncate: float = 4.0) -> torch.Tensor:
    """One axis of RISE's blur kernel, float64 (``kernel_size``,): a centred unit impulse smoothed by a
    Gaussian of ``sigma`` truncated at ``truncate * sigma``, the borders reflected.

    RISE's ``gkern(klen, nsig)`` is ``scipy.ndimage.gaussian_filter`` (mode ``"reflect"``,
    ``truncate=4``) of a ``klen``-square impulse; that filter is separable, so the kernel is the
    outer product of this line with itself. The Gaussian taps ``w_j ~ exp(-j^2 / (2 sigma^2))``,
    ``|j| <= int(truncate * sigma + 0.5)``, fall on the impulse through the half-sample
    reflection of the ``kernel_size`` cells (``d c b a | a b c d | d c b a``): with sigma 5 on 11
    cells most taps fold back, hence a flat kernel (corner 0.0077, centre 0.0088). Sums to 1.

    >>> line = rise_kernel_line()
    >>> round(float(line[0] * line[0]), 5), round(float(line[5] * line[5]), 5)
    (0.00774, 0.00883)
    """
    radius = int(truncate * sigma + 0.5)
    offsets = torch.arange(-radius, radius + 1, dtype=torch.float64)
    taps = torch.exp(-0.5 * offsets ** 2 / sigma ** 2)
    taps = taps / taps.sum()
    centre, period = kernel_size // 2, 2 * kernel_size
    line = torch.zeros(kernel_size, dtype=torch.float64)
    for position in range(kernel_size):
        source = (position + offsets.long()) % period  # where tap j reads, on the reflected axis
        source = torch.where(source >= kernel_size, period - 1 - source, source)
        line[position] = taps[source == centre].sum()
    return line


def gaussian_blur(images: torch.Tensor, kernel_size: int = 11, sigma: float = 5.0) -> torch.Tensor:
    """Each channel convolved with RISE's ``gkern(kernel_size, sigma)`` (:func:`rise_kernel_line`), zero
    padded by ``kernel_size // 2`` (RISE's ``conv2d(x, kern, padding=klen // 2)``).

    >>> round(gaussian_blur(torch.ones(1, 1, 21, 21))[0, 0, 10, 10].item(), 5)   # the centre sees the whole kernel
    1.0
    """
    line = rise_kernel_line(kernel_size, sigma)
    kernel = torch.outer(line, line).to(device=images.device, dtype=images.dtype)
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
