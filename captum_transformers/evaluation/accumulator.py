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


class _BuiltOptions(type):
    """Records a metric's options once its constructor has run, before any update can change an attribute."""

    def __call__(cls, *args, **kwargs):
        metric = super().__call__(*args, **kwargs)
        metric._options = metric._collect_options()
        return metric


_NOT_PLAIN = object()


def _plain(value):
    """``value`` as comparable plain data (tuples for sequences), or ``_NOT_PLAIN`` (callables, models, tensors)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        items = tuple(_plain(v) for v in value)
        return _NOT_PLAIN if any(i is _NOT_PLAIN for i in items) else items
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        items = {k: _plain(v) for k, v in value.items()}
        return _NOT_PLAIN if any(i is _NOT_PLAIN for i in items.values()) else items
    return _NOT_PLAIN


def describe_options(kind: str, options: Dict[str, object]) -> str:
    """``Kind(a=1, b='x')``, the way error messages name a metric and its options."""
    return f"{kind}({', '.join(f'{k}={v!r}' for k, v in options.items())})"


class Accumulator(metaclass=_BuiltOptions):
    """Base class: ``update(...)`` per batch, ``compute()`` a frozen result, ``state()`` the sums.

    Subclasses register their state tensors with ``_add_state(name, shape)`` in ``__init__``
    so every process holds them, with the same shapes, before the first update.

    **Options.** ``options()`` are the public attributes a metric holds once built, those with
    plain values (None, bool, numbers, strings, tuples / lists / dicts of them), minus
    ``ignored_options`` (``max_batch_size`` only splits forward calls; ``generator`` is each
    process's own random stream). Callables (forward, normalize, a callable fill) and models
    cannot be compared and are left out too.
    ``merge`` and ``all_reduce_metrics`` refuse metrics of another class or other options.

    **Reduction.** ``all_reduce_metrics`` leaves each metric holding the totals of all
    processes and marks it ``reduced``. A reduced metric is refused by a second reduction
    (it would multiply every count by the world size), by ``update`` and by ``merge`` with an
    unreduced metric (one process's batches would be mixed into totals, and the processes
    would disagree); two reduced metrics merge (totals of two evaluations). ``reset()``
    starts a new, unreduced evaluation.
    """

    ignored_options = ("max_batch_size", "generator")
    """Attributes left out of ``options()``: they do not change what the metric measures."""

    _reduced = False

    def __init__(self) -> None:
        self._state: Dict[str, torch.Tensor] = {}

    def _collect_options(self) -> Dict[str, object]:
        found = {}
        for name, value in vars(self).items():
            if name.startswith("_") or name in self.ignored_options:
                continue
            plain = _plain(value)
            if plain is not _NOT_PLAIN:
                found[name] = plain
        return found

    def options(self) -> Dict[str, object]:
        """The comparable options this metric was built with (see the class docstring), as a new dict."""
        options = getattr(self, "_options", None)
        return dict(options if options is not None else self._collect_options())

    def kind(self) -> str:
        """The metric's class, as ``module.QualifiedName``."""
        return f"{type(self).__module__}.{type(self).__qualname__}"

    def __repr__(self) -> str:
        return describe_options(type(self).__name__, self.options())

    @property
    def reduced(self) -> bool:
        """True once ``all_reduce_metrics`` has summed this metric over the processes (until ``reset()``)."""
        return self._reduced

    def mark_reduced(self) -> None:
        """Record that the state now holds the totals of all processes (called by ``all_reduce_metrics``)."""
        self._reduced = True

    def _refuse_if_reduced(self, action: str) -> None:
        if self._reduced:
            raise InputError(
                f"Cannot {action} {self!r}: it already holds the totals of all ranks (all_reduce_metrics was called "
                "on it), so data added now would count on this rank only and a further reduction would count every "
                "other batch again. Update every batch before reducing, or call reset() to start a new evaluation.")

    def _add_state(self, name: str, shape=(), exact: bool = False) -> None:
        """Register a zero state; ``exact=True`` for ``exact_sum`` limbs (an extra trailing dim of 2)."""
        shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
        self._state[name] = torch.zeros(shape + ((2,) if exact else ()), dtype=torch.float64)

    def _value(self, name: str) -> torch.Tensor:
        """A state registered with ``exact=True`` as the float64 sum it represents."""
        return limbs_value(self._state[name])

    def _add(self, name: str, value: torch.Tensor) -> None:
        self._refuse_if_reduced("update")
        self._state[name] += value.detach().to(device="cpu", dtype=torch.float64)

    def state(self) -> Dict[str, torch.Tensor]:
        """The live float64 state tensors; reducing them in place with SUM merges shards exactly."""
        return self._state

    def reset(self) -> None:
        """Zero every state tensor and clear ``reduced`` (start a new evaluation)."""
        for tensor in self._state.values():
            tensor.zero_()
        self._reduced = False

    def merge(self, other: "Accumulator") -> "Accumulator":
        """Add ``other``'s state into this one (the in-process equivalent of all_reduce SUM).

        Refuses another class, other options (both are named), differently shaped states, and a
        reduced metric with an unreduced one (see the class docstring); this metric is then unchanged.
        """
        if not isinstance(other, Accumulator):
            raise InputError(f"Cannot merge an object of type {type(other).__name__} into {self!r}: expected a "
                             "metric of the same class built with the same options.")
        if type(other) is not type(self) or other.options() != self.options():
            differing = sorted(k for k in set(self.options()) | set(other.options())
                               if self.options().get(k, _NOT_PLAIN) != other.options().get(k, _NOT_PLAIN))
            what = ("of another class" if type(other) is not type(self)
                    else f"built with other options ({', '.join(differing)} differ)")
            raise InputError(
                f"Cannot merge {other!r} into {self!r}: it is {what}, so their sums measure different things. "
                "Merge only metrics of the same class built with the same options.")
        if other.state().keys() != self._state.keys() or any(
            other.state()[k].shape != v.shape for k, v in self._state.items()
        ):
            raise InputError(
                f"Cannot merge {other!r} into {self!r}: their states differ in kind or shape "
                f"({ {k: tuple(v.shape) for k, v in other.state().items()} } vs "
                f"{ {k: tuple(v.shape) for k, v in self._state.items()} }). Merge only metrics built with the same "
                "options.")
        if other.reduced != self._reduced:
            reduced, local = (self, other) if self._reduced else (other, self)
            raise InputError(
                f"Cannot merge: {reduced!r} already holds the totals of all ranks (all_reduce_metrics was called on "
                f"it) but {local!r} holds one rank's batches; the sum would be neither. Merge metrics before reducing, "
                "or merge two reduced ones; reset() starts a new evaluation.")
        for name, tensor in self._state.items():
            tensor += other.state()[name]
        return self

    def compute(self):  # pragma: no cover - every metric overrides it
        raise NotImplementedError
