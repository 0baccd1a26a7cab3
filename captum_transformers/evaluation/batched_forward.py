"""Running a model over all perturbation steps of a batch in as few forward calls as possible.

A perturbation metric needs the model's logits for ``T`` perturbed copies of a batch of ``B``
examples. Stacking the copies step-major into one batch of ``T * B`` rows costs one forward
call; ``max_batch_size`` bounds the rows (and the perturbed copies held in memory) per call.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from ..errors import InputError
from .validation import require_labels_in_range, require_nonempty_batch

Forward = Callable[[Any], torch.Tensor]


def batch_rows(inputs: Any) -> int:
    """Number of rows (dim 0) of a tensor, or of the first tensor in a nested dict/tuple/list."""
    if isinstance(inputs, torch.Tensor):
        return inputs.shape[0]
    if isinstance(inputs, Mapping):
        return batch_rows(next(iter(inputs.values())))
    if isinstance(inputs, (tuple, list)):
        return batch_rows(inputs[0])
    raise InputError(f"Model inputs must be tensors or dicts/tuples of tensors, got {type(inputs).__name__}.")


def slice_rows(inputs: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of every tensor in a nested dict/tuple/list of tensors."""
    if isinstance(inputs, torch.Tensor):
        return inputs[start:stop]
    if isinstance(inputs, Mapping):
        return {k: slice_rows(v, start, stop) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(slice_rows(v, start, stop) for v in inputs)
    return inputs


def check_max_batch_size(max_batch_size: Optional[int]) -> Optional[int]:
    if max_batch_size is not None and (not isinstance(max_batch_size, int) or max_batch_size < 1):
        raise InputError(f"max_batch_size={max_batch_size!r} must be a positive int or None (no limit).")
    return max_batch_size


@torch.no_grad()
def logits_per_step(
    forward: Forward,
    build_steps: Callable[[Sequence[int]], Any],
    n_steps: int,
    batch_size: int,
    max_batch_size: Optional[int] = None,
    labels: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Logits of shape (n_steps, batch_size, C) for the perturbed batches of every step.

    ``build_steps(steps)`` returns the model input for the listed steps stacked step-major
    (``len(steps) * batch_size`` rows). Steps are grouped so each ``forward`` call sees at most
    ``max_batch_size`` rows (all steps in one call when ``None``); a batch larger than
    ``max_batch_size`` is itself split. An empty batch is refused; ``labels`` (B,), when
    given, are checked against the number of classes the first forward call returns.

    >>> logits_per_step(lambda x: x, lambda s: torch.tensor(s).repeat_interleave(2)[:, None].float(), 3, 2).shape
    torch.Size([3, 2, 1])
    """
    require_nonempty_batch(batch_size)
    steps_per_call = n_steps if max_batch_size is None else max(1, max_batch_size // max(batch_size, 1))
    chunks = []
    for first in range(0, n_steps, steps_per_call):
        steps = list(range(first, min(first + steps_per_call, n_steps)))
        inputs = build_steps(steps)
        rows = len(steps) * batch_size
        call_rows = rows if max_batch_size is None else max_batch_size
        for start in range(0, rows, call_rows):
            logits = forward(slice_rows(inputs, start, min(start + call_rows, rows)))
            if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
                raise InputError(
                    f"forward must return logits of shape (batch, classes); got "
                    f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}. "
                    "Wrap the model so it returns model(...).logits."
                )
            if labels is not None and not chunks:
                require_labels_in_range(labels, logits.shape[-1])
            chunks.append(logits.detach())
    return torch.cat(chunks).reshape(n_steps, batch_size, -1)
