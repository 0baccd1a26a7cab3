"""Dropping tokens from a padded batch: left-pack the kept ones and re-pad."""
from __future__ import annotations

from typing import Tuple

import torch

from ...errors import InputError
from ..validation import require_tensor


def compact_tokens(values: torch.Tensor, keep: torch.Tensor, pad_value=0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Left-pack the kept tokens of every row, in their original order, and pad to the longest row.

    ``values`` is (B, S, ...) and ``keep`` (B, S) bool. Returns ``(packed, mask)`` with
    ``packed`` of shape (B, L, ...) and ``mask`` (B, L) bool, L = max kept count per row:
    ``packed[b, :n_b] = values[b][keep[b]]``, the rest is ``pad_value`` and mask False.
    Vectorised: one stable sort moves kept tokens to the front. L may be 0.

    >>> packed, mask = compact_tokens(torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([[1, 0, 1], [0, 1, 0]]).bool())
    >>> packed.tolist(), mask.tolist()
    ([[1, 3], [5, 0]], [[True, True], [True, False]])
    """
    values = require_tensor("values", values)
    keep = require_tensor("keep", keep, ndim=(2,))
    if values.dim() < 2 or tuple(values.shape[:2]) != tuple(keep.shape):
        raise InputError(
            f"values of shape {tuple(values.shape)} and keep of shape {tuple(keep.shape)} do not match: expected "
            "values (B, S, ...) with keep (B, S). Pass one keep flag per token."
        )
    keep = keep.to(device=values.device, dtype=torch.bool)
    kept = keep.sum(dim=1)
    length = int(kept.max()) if keep.numel() else 0
    order = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices[:, :length]
    index = order.reshape(*order.shape, *([1] * (values.dim() - 2))).expand(-1, -1, *values.shape[2:])
    packed = values.gather(1, index)
    mask = torch.arange(length, device=values.device)[None, :] < kept[:, None]
    pad = torch.as_tensor(pad_value, dtype=values.dtype, device=values.device)
    packed = torch.where(mask.reshape(*mask.shape, *([1] * (values.dim() - 2))), packed, pad)
    return packed, mask
