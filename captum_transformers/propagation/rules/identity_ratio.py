"""The ratio ``y / x`` through which the identity rule (``R_in = R_out``) passes relevance in
gradient x input form; shared by the operation rules, the pixel rule and the recomputed softmax."""
from __future__ import annotations

import torch


def identity_ratio(output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``y / x`` for the identity rule in gradient x input form, 0 where ``x == 0``.

    No stabiliser: ``R_x = x * (g * y / x) = y * g = R_y`` exactly, however small ``x`` is. A
    shifted denominator (``x + eps``) would give ``R_x = R_y * x / (x + eps)``, which is not the
    identity (half the relevance at ``|x| = eps``). Relevance on an exact zero (or where the
    ratio overflows) is dropped: ``y / 0`` is never finite, so one pass mapping every
    non-finite ratio to 0 covers both. Computed in at least float32.
    """
    dtype = torch.promote_types(torch.promote_types(x.dtype, output.dtype), torch.float32)
    return torch.div(output.to(dtype), x.to(dtype)).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
