"""The accumulator contract every metric follows, and exact float64 sums.

A metric keeps only sums and counts, as float64 tensors returned (live, not copied) by
``state()``. Summing each state tensor over shards (``torch.distributed.all_reduce`` with
``SUM``, or ``merge``) therefore reproduces the single-process state. To make that hold
*exactly*, not just to rounding, per-example real values are rounded to a multiple of a
power of two (``2**-32`` for values in [0, 1]) before they are added: sums of such values are
exact integers times that power in float64, so addition becomes associative and the order
of batches, shards or the reduction tree cannot change a single bit.
"""
from __future__ import annotations

from typing import Dict

import torch

from ..errors import InputError

UNIT_RESOLUTION = 2.0 ** -32
"""Grid for per-example values in [0, 1]: error <= 1.2e-10 each; sums stay exact up to 2**21 (2M) examples."""

WIDE_RESOLUTION = 2.0 ** -20
"""Grid for unbounded per-example values (squared logit errors): error <= 5e-7 each; sums exact up to 2**33."""


def exact_sum(values: torch.Tensor, dim: int = 0, resolution: float = UNIT_RESOLUTION) -> torch.Tensor:
    """Sum of ``values`` along ``dim`` after rounding each to a multiple of ``resolution``.

    ``exact_sum(v) == round(v / r).sum() * r`` in float64, which is independent of the order
    of summation while the total stays below ``2**53 * r``.

    >>> exact_sum(torch.tensor([0.1, 0.2])) + exact_sum(torch.tensor([0.3])) == exact_sum(torch.tensor([0.1, 0.2, 0.3]))
    tensor(True)
    """
    grid = torch.round(values.to(torch.float64) / resolution)
    return grid.sum(dim=dim) * resolution


class Accumulator:
    """Base class: ``update(...)`` per batch, ``compute()`` a frozen result, ``state()`` the sums.

    Subclasses register their state tensors with ``_add_state(name, shape)`` in ``__init__``
    so every process holds them, with the same shapes, before the first update.
    """

    def __init__(self) -> None:
        self._state: Dict[str, torch.Tensor] = {}

    def _add_state(self, name: str, shape=()) -> None:
        self._state[name] = torch.zeros(shape, dtype=torch.float64)

    def _add(self, name: str, value: torch.Tensor) -> None:
        self._state[name] += value.detach().to(device="cpu", dtype=torch.float64)

    def state(self) -> Dict[str, torch.Tensor]:
        """The live float64 state tensors; reducing them in place with SUM merges shards exactly."""
        return self._state

    def reset(self) -> None:
        """Zero every state tensor (start a new evaluation)."""
        for tensor in self._state.values():
            tensor.zero_()

    def merge(self, other: "Accumulator") -> "Accumulator":
        """Add ``other``'s state into this one (the in-process equivalent of all_reduce SUM)."""
        if type(other) is not type(self) or other._state.keys() != self._state.keys() or any(
            other._state[k].shape != v.shape for k, v in self._state.items()
        ):
            raise InputError(
                f"Cannot merge {type(other).__name__} into {type(self).__name__}: their states differ in kind or "
                "shape. Merge only metrics built with the same options."
            )
        for name, tensor in self._state.items():
            tensor += other._state[name]
        return self

    def compute(self):  # pragma: no cover - every metric overrides it
        raise NotImplementedError
