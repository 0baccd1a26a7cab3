"""Input checks shared by the metrics; each failure raises ``InputError`` saying what was
received, what was expected and how to fix it."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..errors import InputError


def require_tensor(name: str, value, ndim: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Return ``value`` if it is a tensor with one of the allowed numbers of dimensions."""
    if not isinstance(value, torch.Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(value).__name__}. Convert it with torch.as_tensor.")
    if ndim is not None and value.dim() not in tuple(ndim):
        raise InputError(
            f"{name} has shape {tuple(value.shape)} ({value.dim()} dims) but {' or '.join(map(str, ndim))} dims "
            "were expected. Check the batch layout documented for this metric."
        )
    return value


def require_same_shape(names: Sequence[str], tensors: Sequence[torch.Tensor], dims: Optional[int] = None) -> None:
    """Raise unless all tensors share their first ``dims`` sizes (all sizes when ``None``)."""
    shapes = [tuple(t.shape) if dims is None else tuple(t.shape[:dims]) for t in tensors]
    if len(set(shapes)) > 1:
        listing = ", ".join(f"{n}={tuple(t.shape)}" for n, t in zip(names, tensors))
        what = "shape" if dims is None else f"first {dims} dims"
        raise InputError(f"Expected the same {what} for {', '.join(names)}; got {listing}. Pass matching batches.")


def require_labels(labels, batch: int, name: str = "labels") -> torch.Tensor:
    """Integer class labels of shape (batch,)."""
    labels = require_tensor(name, labels, ndim=(1,))
    require_nonempty_batch(batch)
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise InputError(f"{name} must hold integer class indices, got dtype {labels.dtype}. Use labels.long().")
    if labels.shape[0] != batch:
        raise InputError(f"{name} has {labels.shape[0]} entries but the batch has {batch}. Pass one label per example.")
    return labels.long()


def require_nonempty_batch(batch: int) -> None:
    """A batch of 0 examples has no score to average; refused rather than crashing on an empty reshape."""
    if batch == 0:
        raise InputError("The batch is empty (0 examples); a metric update needs at least one. Skip empty batches "
                         "(e.g. the last one of a filtered loader) before calling update.")


def require_labels_in_range(labels: torch.Tensor, num_classes: int, name: str = "labels") -> None:
    """Class indices must address one of the model's ``num_classes`` outputs (``logits.shape[-1]``).

    An index out of range would crash in ``gather`` or count as a silent miss in an accuracy.

    >>> require_labels_in_range(torch.tensor([0, 2]), 3)
    """
    outside = (labels < 0) | (labels >= num_classes)
    if bool(outside.any()):
        bad = sorted(set(labels[outside].tolist()))
        raise InputError(f"{name} {bad[:5]} are outside the model's {num_classes} classes (0 to {num_classes - 1}, "
                         f"read from the logits' last dim). Pass class indices of this model's output, e.g. "
                         "logits.argmax(-1).")


def require_finite(name: str, value: torch.Tensor) -> None:
    """Rankings of NaN or infinite scores are undefined, so they are refused."""
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        raise InputError(
            f"{name} holds NaN or infinite values; rankings of them are undefined. "
            "Replace them (e.g. torch.nan_to_num) before updating the metric."
        )


def require_fractions(fractions, low: float = 0.0, high: float = 1.0) -> tuple:
    """Increasing fractions within [low, high], returned as a tuple of floats."""
    values = tuple(float(f) for f in fractions)
    if not values or any(not low <= f <= high for f in values) or any(b <= a for a, b in zip(values, values[1:])):
        raise InputError(
            f"fractions={values} must be a non-empty, strictly increasing sequence within [{low}, {high}], "
            "e.g. (0.0, 0.1, ..., 0.9)."
        )
    return values


def require_choice(name: str, value, choices: Sequence) -> None:
    if value not in choices:
        raise InputError(f"{name}={value!r} is not one of {tuple(choices)}. Pick one of those.")


def require_positive_int(name: str, value) -> int:
    """Return ``value`` if it is an int of at least 1 (a bool is refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{name}={value!r} must be a positive int.")
    return value
