"""Captum's target forms, resolved against a batch of model outputs.

Accepted, as in Captum: ``None``, an int, a tuple of ints (an index into the non-batch
dims), a 0-d or per-example tensor, or a per-example list of ints or tuples. ``None``
explains the predicted class (the arg-max per example) unless the output already is one
score per example.
"""
from __future__ import annotations

from typing import Any, Tuple

import torch

from ..errors import InputError


def _check_index(index: Tuple[int, ...], shape: Tuple[int, ...], what: str) -> None:
    if len(index) != len(shape):
        raise InputError(
            f"{what} {index} has {len(index)} index(es) but the model output has {len(shape)} non-batch "
            f"dimension(s) of sizes {tuple(shape)}. Give one index per non-batch dimension."
        )
    for i, size in zip(index, shape):
        if not -size <= i < size:
            raise InputError(
                f"{what} {index} is out of range for model output of non-batch shape {tuple(shape)}. "
                f"Use a class index in [0, {size})."
            )


def select_targets(output: torch.Tensor, target: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    """Return ``(scores, index)``: the explained score per example (B,) and its index (B, D)."""
    batch = output.shape[0]
    inner = tuple(output.shape[1:])
    flat = output.reshape(batch, -1)
    if target is None:
        if not inner:
            return output, torch.zeros(batch, 0, dtype=torch.long, device=output.device)
        flat_index = flat.detach().argmax(dim=1)
        index = torch.stack(torch.unravel_index(flat_index, inner), dim=1)
        return flat.gather(1, flat_index[:, None]).squeeze(1), index
    if not inner:
        raise InputError(
            f"target={target!r} was given but the model output has shape {tuple(output.shape)}: one score per "
            "example. Pass target=None."
        )
    if isinstance(target, torch.Tensor):
        if target.is_floating_point():
            raise InputError(f"target tensor must hold integers, got dtype {target.dtype}.")
        if target.numel() == 1:
            target = int(target.item())
        elif target.dim() == 1 and len(inner) == 1:
            target = target.tolist()
        elif target.dim() == 2:
            target = [tuple(row) for row in target.tolist()]
        else:
            raise InputError(
                f"target tensor of shape {tuple(target.shape)} does not fit a batch of {batch}; expected a "
                f"scalar or shape ({batch},)."
            )
    if isinstance(target, int):
        rows = [(target,)] * batch
    elif isinstance(target, tuple):
        rows = [tuple(target)] * batch
    elif isinstance(target, list):
        if len(target) != batch:
            raise InputError(
                f"target has {len(target)} entries but the batch has {batch} examples. Give one target per "
                "example, or a single int for all."
            )
        rows = [tuple(t) if isinstance(t, (tuple, list)) else (int(t),) for t in target]
    else:
        raise InputError(
            f"target of type {type(target).__name__} is not understood; use an int, a tuple, a tensor or a list."
        )
    for row in rows:
        _check_index(row, inner, "target")
    index = torch.tensor(rows, dtype=torch.long, device=output.device)
    sizes = torch.tensor(inner, device=output.device)
    index = torch.where(index < 0, index + sizes, index)
    strides = torch.tensor([int(torch.tensor(inner[i + 1:]).prod()) for i in range(len(inner))], device=output.device)
    flat_index = (index * strides).sum(dim=1)
    return flat.gather(1, flat_index[:, None]).squeeze(1), index
