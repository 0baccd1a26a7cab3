"""The accumulator contract every metric follows, and exact float64 sums.

A metric keeps only sums and counts, as float64 tensors returned (live, not copied) by
``state()``. Summing each state tensor over shards (``torch.distributed.all_reduce`` with
``SUM``, or ``merge``) therefore reproduces the single-process state. To make that hold
*exactly*, not just to rounding, sums of real per-example values are kept in fixed point:
each value is rounded to a multiple of ``2**-40`` and the integer it becomes is split into a
high and a low limb, summed separately. Every limb sum is an integer below ``2**53``, so
float64 adds it exactly and the order of batches, shards or the reduction tree cannot change
a single bit. (A single float64 grid would force a choice between resolution and range:
squared logit errors of an untrained model are ~1e-8, of a trained one ~1e2.)
"""
from __future__ import annotations

from typing import Dict

import torch

from ..errors import InputError

FRACTION_BITS = 40
"""Values are rounded to multiples of 2**-40 (about 9e-13)."""

LOW_BITS = 26
"""The low limb holds the last 26 bits: up to 2**27 examples sum exactly in it."""

_MAX_MAGNITUDE = 2.0 ** 22  # keeps value * 2**40 well inside int64


def exact_sum(values: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Fixed-point sum of ``values`` along ``dim``, as float64 limbs of shape (..., 2).

    With ``q = round(v * 2**40)`` per value, the limbs are ``sum(q // 2**26)`` and
    ``sum(q mod 2**26)``; ``limbs_value`` turns them back into the sum. Limb sums of disjoint
    parts add up exactly to the limbs of the whole, in any order. Values must satisfy
    ``|v| < 2**22``; totals stay exact up to about ``2**39`` (5e11).

    >>> parts = exact_sum(torch.tensor([0.1, 0.2])) + exact_sum(torch.tensor([0.3]))
    >>> bool((parts == exact_sum(torch.tensor([0.1, 0.2, 0.3]))).all()), round(float(limbs_value(parts)), 6)
    (True, 0.6)
    """
    values = values.detach().to(torch.float64)
    if not bool((values.abs() < _MAX_MAGNITUDE).all()):
        raise InputError(
            f"A per-example value of magnitude {float(values.abs().max()):.3g} reached the metric; exact sums hold "
            f"values below {_MAX_MAGNITUDE:.3g}. Check the model's logits (are they finite and reasonably scaled?)."
        )
    fixed = torch.round(values * 2.0 ** FRACTION_BITS).to(torch.int64)
    high = torch.div(fixed, 2 ** LOW_BITS, rounding_mode="floor")
    low = fixed - high * 2 ** LOW_BITS
    return torch.stack([high.sum(dim=dim), low.sum(dim=dim)], dim=-1).to(torch.float64)


def limbs_value(limbs: torch.Tensor) -> torch.Tensor:
    """The float64 sum represented by ``exact_sum`` limbs (..., 2)."""
    return limbs[..., 0] * 2.0 ** (LOW_BITS - FRACTION_BITS) + limbs[..., 1] * 2.0 ** -FRACTION_BITS


class Accumulator:
    """Base class: ``update(...)`` per batch, ``compute()`` a frozen result, ``state()`` the sums.

    Subclasses register their state tensors with ``_add_state(name, shape)`` in ``__init__``
    so every process holds them, with the same shapes, before the first update.
    """

    def __init__(self) -> None:
        self._state: Dict[str, torch.Tensor] = {}

    def _add_state(self, name: str, shape=(), exact: bool = False) -> None:
        """Register a zero state; ``exact=True`` for ``exact_sum`` limbs (an extra trailing dim of 2)."""
        shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
        self._state[name] = torch.zeros(shape + ((2,) if exact else ()), dtype=torch.float64)

    def _value(self, name: str) -> torch.Tensor:
        """A state registered with ``exact=True`` as the float64 sum it represents."""
        return limbs_value(self._state[name])

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
