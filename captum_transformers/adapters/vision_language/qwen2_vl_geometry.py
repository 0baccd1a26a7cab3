r"""Where Qwen2-VL's and Qwen2.5-VL's image tokens come from in the image.

The processor resizes an image to ``(h P, w P)`` pixels (``P`` the patch size, ``h`` and ``w``
multiples of the merge size ``m``), cuts it into ``h w`` patches and lays them out merge block
by merge block: row ``((R \cdot w/m + C) m + a) m + b`` of ``pixel_values`` is patch
``(R m + a, C m + b)``, each row holding ``(channel, temporal copy, y, x)`` values (a still
image is repeated over the ``T`` temporal copies). The vision tower's PatchMerger concatenates
each ``m \times m`` run of rows into one token, so the ``k``-th placeholder token of an image is
the merged cell

.. math:: (R, C) = (\lfloor k / (w/m) \rfloor,\; k \bmod (w/m)),

covering pixels ``[R m P, (R+1) m P) x [C m P, (C+1) m P)`` of the resized image. Qwen2.5-VL's
window attention permutes the patches inside the tower and undoes it after the merger, so its
map is the same. Images of a batch are concatenated in ``pixel_values`` in the order of
``image_grid_thw``, and fill the placeholder tokens in reading order (batch row by row).

Example::

    >>> grid = ImageGrid(1, 4, 6, patch=4, merge=2)
    >>> grid.image_size, grid.num_tokens           # ((16, 24), 6)
    >>> grid.tokens_to_pixels(torch.arange(6.)).shape   # (16, 24): each token's 8x8 cell
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch

from ...errors import InputError


@dataclass(frozen=True)
class ImageGrid:
    """One image's patch grid: ``t`` temporal patches, ``h x w`` patches of ``patch`` pixels,
    merged ``merge x merge``."""

    t: int
    h: int
    w: int
    patch: int
    merge: int

    @property
    def num_patches(self) -> int:
        return self.t * self.h * self.w

    @property
    def num_tokens(self) -> int:
        """Placeholder tokens of this image in the decoder's sequence."""
        return self.num_patches // self.merge ** 2

    @property
    def merged_shape(self) -> Tuple[int, int]:
        return self.h // self.merge, self.w // self.merge

    @property
    def image_size(self) -> Tuple[int, int]:
        """(H, W) of the processor's resized image, the layout of the maps."""
        return self.h * self.patch, self.w * self.patch

    def tokens_to_pixels(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores over this image's placeholder tokens (..., num_tokens) as (..., H, W): each
        token's value on every pixel of its merged cell."""
        if scores.shape[-1] != self.num_tokens:
            raise InputError(f"Expected {self.num_tokens} image-token scores for a {self.h}x{self.w}-patch image, "
                             f"got {scores.shape[-1]}.")
        cells = scores.reshape(*scores.shape[:-1], *self.merged_shape)
        side = self.merge * self.patch
        return cells.repeat_interleave(side, dim=-2).repeat_interleave(side, dim=-1)

    def patches_to_image(self, rows: torch.Tensor, channels: int, temporal: int) -> torch.Tensor:
        """This image's ``pixel_values`` rows (h w, C T P P) back to the resized image's layout
        (C, H, W), summed over the temporal copies (the inverse of the processor's patchify,
        up to that sum): a relevance per pixel and channel."""
        m, p = self.merge, self.patch
        if rows.shape != (self.num_patches, channels * temporal * p * p):
            raise InputError(f"Expected pixel rows of shape {(self.num_patches, channels * temporal * p * p)} for a "
                             f"{self.h}x{self.w}-patch image, got {tuple(rows.shape)}.")
        blocks = rows.reshape(self.h // m, self.w // m, m, m, channels, temporal, p, p)
        # (R, C, a, b, channel, copy, y, x) -> (channel, copy, R, a, y, C, b, x)
        image = blocks.permute(4, 5, 0, 2, 6, 1, 3, 7).reshape(channels, temporal, self.h * p, self.w * p)
        return image.sum(dim=1)


def patchify(images: torch.Tensor, patch: int, merge: int, temporal: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(n, C, H, W) images (normalized as the processor does; H and W multiples of ``patch * merge``)
    as the processor lays them out: ``pixel_values`` rows (n h w, C T P P), each still image
    repeated over the ``T`` temporal copies, and ``image_grid_thw`` (n, 3). Differentiable: the
    relevance of ``x * dy/dx`` at ``images`` sums each pixel's copies."""
    count, channels, height, width = images.shape
    side = patch * merge
    if height % side or width % side:
        raise InputError(f"Images of {height}x{width} pixels are not multiples of patch_size * merge_size = {side}; "
                         "resize them (the model's processor does), or pass its pixel_values and image_grid_thw.")
    h, w = height // patch, width // patch
    blocks = images.reshape(count, channels, h // merge, merge, patch, w // merge, merge, patch)
    # (image, channel, R, a, y, C, b, x) -> (image, R, C, a, b, channel, y, x), then the temporal copies
    blocks = blocks.permute(0, 2, 5, 3, 6, 1, 4, 7).unsqueeze(6)
    rows = blocks.expand(*blocks.shape[:6], temporal, patch, patch).reshape(count * h * w, -1)
    return rows, torch.tensor([[1, h, w]] * count, device=images.device)


def image_grids(image_grid_thw: torch.Tensor, patch: int, merge: int) -> List[ImageGrid]:
    """One :class:`ImageGrid` per row of ``image_grid_thw``; videos (t > 1) and grids the merger
    cannot tile are refused."""
    if image_grid_thw.dim() != 2 or image_grid_thw.shape[1] != 3:
        raise InputError(f"image_grid_thw must be (num_images, 3) rows of (t, h, w); got shape "
                         f"{tuple(image_grid_thw.shape)}.")
    grids = []
    for index, (t, h, w) in enumerate(image_grid_thw.tolist()):
        if t != 1:
            raise InputError(f"Image {index} has t={t} temporal patches (a video); Qwen2-VL maps are made for still "
                             "images (t=1). Explain the frames as separate images.")
        if h % merge or w % merge:
            raise InputError(f"Image {index} has a {h}x{w} patch grid, not a multiple of spatial_merge_size={merge}; "
                             "use the model's processor, which resizes to multiples of patch_size * merge_size.")
        grids.append(ImageGrid(t, h, w, patch, merge))
    return grids


def patch_row_spans(grids: List[ImageGrid]) -> List[Tuple[int, int]]:
    """[start, stop) rows of ``pixel_values`` of each image (images are concatenated in order)."""
    spans, start = [], 0
    for grid in grids:
        spans.append((start, start + grid.num_patches))
        start += grid.num_patches
    return spans
