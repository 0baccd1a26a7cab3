"""Captum's target forms, resolved against a batch of model outputs.

Accepted, as in Captum: ``None``, an int, a tuple of ints (an index into the non-batch
dims), a 0-d or per-example tensor, or a per-example list of ints or tuples. ``None``
explains the predicted class (the arg-max per example) unless the output already is one
score per example. Booleans are refused: Python counts ``True`` as ``1``, so ``target=True``
would silently explain class 1.

A model's output is read as scores by :func:`output_scores`: a tensor, the first tensor of
a tuple, the ``"logits"`` entry of a mapping (a dict, or a HuggingFace ``ModelOutput``), or a
question-answering output's start and end scores stacked as (B, 2, N) (:func:`span_scores`).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple

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


#: Extractive question answering's outputs: one start and one end score per token.
SPAN_FIELDS = ("start_logits", "end_logits")


def span_scores(output: Any) -> Any:
    """``start_logits`` and ``end_logits`` (B, N) of a question-answering output stacked as
    (B, 2, N), so that ``target=(0, i)`` is the start score of token ``i`` and ``(1, i)`` its end
    score; None for any other output."""
    if not isinstance(output, Mapping) or isinstance(output.get("logits"), torch.Tensor):
        return None
    spans = [output.get(field) for field in SPAN_FIELDS]
    if all(isinstance(value, torch.Tensor) for value in spans) and spans[0].shape == spans[1].shape:
        return torch.stack(spans, dim=1)
    return None


def output_scores(output: Any) -> Any:
    """The score tensor of a model output that is a mapping: its ``"logits"`` entry.

    ``{"logits": s, ...}`` and a HuggingFace ``ModelOutput`` give ``s``; a mapping without
    ``"logits"`` is refused (picking another entry could explain the wrong quantity); any
    other output is returned as is.

    Example: ``output_scores({"logits": scores, "hidden": h}) is scores``.
    """
    if not isinstance(output, Mapping):
        return output
    spans = span_scores(output)
    if spans is not None:
        return spans
    scores = output.get("logits")
    if not isinstance(scores, torch.Tensor):
        found = {key: type(value).__name__ for key, value in output.items()}
        raise InputError(
            f"The model returned a {type(output).__name__} with entries {found} but no 'logits' tensor; expected a "
            "tensor of scores, or a mapping whose 'logits' entry holds them. Return {'logits': scores, ...} or wrap "
            "the model in an nn.Module whose forward returns the score tensor to explain."
        )
    return scores


def _is_boolean(value: Any) -> bool:
    """Python and numpy booleans, and bool tensors or arrays (numpy is not imported)."""
    if isinstance(value, bool):
        return True
    dtype = getattr(value, "dtype", None)
    return dtype is torch.bool or str(dtype) == "bool"


def _refuse_booleans(target: Any) -> None:
    entries = target if isinstance(target, (list, tuple)) else [target]
    nested = [v for entry in entries for v in (entry if isinstance(entry, (list, tuple)) else [entry])]
    if any(_is_boolean(value) for value in nested):
        raise InputError(
            f"target={target!r} holds booleans; a target is a class index (an int, a tuple of ints, an integer "
            "tensor or a list of them), and True would silently count as class 1. Pass the class as an int "
            "(e.g. target=1), or None for the predicted class."
        )


def target_width(target: Any) -> Optional[int]:
    """How many indices per example ``target`` names, in :func:`select_targets`' forms (an int
    or a list of ints: 1; a tuple, a list of tuples or a (B, D) tensor: its length D); None for
    ``target=None`` or a form :func:`select_targets` refuses."""
    if isinstance(target, torch.Tensor):
        return 1 if target.dim() < 2 else int(target.shape[1])
    if isinstance(target, int):
        return 1
    if isinstance(target, tuple):
        return len(target)
    if isinstance(target, list) and target:
        widths = {len(t) if isinstance(t, (tuple, list)) else 1 for t in target}
        return widths.pop() if len(widths) == 1 else None
    return None


def select_targets(output: torch.Tensor, target: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    """Return ``(scores, index)``: the explained score per example (B,) and its index (B, D)."""
    batch = output.shape[0]
    inner = tuple(output.shape[1:])
    flat = output.reshape(batch, -1)
    _refuse_booleans(target)
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
