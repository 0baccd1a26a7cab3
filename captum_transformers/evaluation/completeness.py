"""Completeness error of attributions: how far their sum is from the score they explain
(LibraGrad, Mehri et al., CVPR 2025, Eq. 1; the completeness axiom of Sundararajan et al., 2017).

Per example, with ``R`` its relevance (any shape) and ``s`` the explained score::

    error = |sum_i R_i - s| / |s|        (relative=True, default)
    error = |sum_i R_i - s|              (relative=False)

**Which score.** The caller passes ``s``: the *logit* of the explained class for methods
that distribute the logit (LRP, AttnLRP, Input x Gradient of a piecewise-linear model; the
pre-softmax output, since the softmax is not propagated), or ``f(x) - f(baseline)`` for
Integrated Gradients and other baseline-relative methods. A method that conserves its
score exactly has error 0 up to rounding.

The result holds the mean error (exact fixed-point sums), the maximum, the number of
examples and how many exceed ``tolerance``. The maximum cannot be summed across processes,
so it is read from a histogram that can: each error falls into a bin of its float64 value
(exponent and the top 8 mantissa bits), and ``max_error`` is the upper edge of the highest
non-empty bin: an upper bound at most 2**-8 (0.4 %) above the largest error; errors below
2**-40 share one bin whose upper edge is 2**-40.

Example::

    metric = CompletenessError()
    metric.update(relevance, logits.gather(1, targets[:, None]).squeeze(1))   # relevance (B, ...), scores (B,)
    metric.compute().mean_error
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import InputError
from .accumulator import Accumulator, exact_sum
from .results import ResultRecord
from .validation import require_finite, require_nonempty_batch, require_tensor

_MANTISSA_BITS = 8
_LOWEST_EXPONENT, _HIGHEST_EXPONENT = -40, 22  # bins cover [0, 2**22): exact_sum refuses larger errors
_SHIFT = 52 - _MANTISSA_BITS
_FIRST_KEY = (_LOWEST_EXPONENT + 1023) << _MANTISSA_BITS  # the bit pattern of 2**-40, shifted
_BINS = 1 + ((_HIGHEST_EXPONENT - _LOWEST_EXPONENT) << _MANTISSA_BITS)  # bin 0: [0, 2**-40)


def error_bins(errors: torch.Tensor) -> torch.Tensor:
    """Histogram bin of each non-negative float64 error: 0 below 2**-40, else 1 + its shifted bit pattern.

    Positive float64 bit patterns order like their values, so bins are ordered too.

    >>> error_bins(torch.tensor([0.0, 1.0, 1.5], dtype=torch.float64)).tolist()
    [0, 10241, 10369]
    """
    keys = torch.bitwise_right_shift(errors.to(torch.float64).view(torch.int64), _SHIFT) - _FIRST_KEY
    return torch.where(errors < 2.0 ** _LOWEST_EXPONENT, torch.zeros_like(keys), keys + 1)


def bin_upper_edge(index: int) -> float:
    """The largest value bin ``index`` can hold (exclusive upper edge)."""
    key = torch.tensor([(index + _FIRST_KEY) << _SHIFT], dtype=torch.int64)
    return float(key.view(torch.float64))


@dataclass(frozen=True)
class CompletenessResult(ResultRecord):
    """Mean and max completeness error over ``count`` examples; ``above_tolerance`` of them exceed ``tolerance``.

    ``max_error`` is an upper bound at most 0.4 % above the largest error (see the module docstring).
    """

    name: str
    mean_error: float
    max_error: float
    count: int
    above_tolerance: int
    tolerance: float
    relative: bool = True
    higher_is_better: bool = False


class CompletenessError(Accumulator):
    """Completeness error ``|sum R - s| / |s|`` per example (see the module docstring); lower is better.

    ``relative=False`` reports ``|sum R - s|``. ``tolerance`` (default 1e-2) sets which
    errors ``above_tolerance`` counts. With ``relative=True`` a score of exactly 0 makes the
    error undefined and is refused; errors of 2**22 or more (a score near 0) are refused too,
    naming the example. An empty batch is refused.
    """

    def __init__(self, relative: bool = True, tolerance: float = 1e-2) -> None:
        super().__init__()
        if not isinstance(relative, bool):
            raise InputError(f"relative must be True or False, got {relative!r}.")
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance >= 0:
            raise InputError(f"tolerance={tolerance!r} must be a number >= 0.")
        self.relative = relative
        self.tolerance = float(tolerance)
        self._add_state("error_sum", exact=True)
        self._add_state("count")
        self._add_state("above_tolerance")
        self._add_state("histogram", (_BINS,))

    def update(self, relevance: torch.Tensor, scores: torch.Tensor) -> None:
        """Add a batch: relevance (B, ...) summed per example, scores (B,) (the explained scores)."""
        relevance = require_tensor("relevance", relevance)
        scores = require_tensor("scores", scores, ndim=(1,))
        if relevance.dim() < 1 or relevance.shape[0] != scores.shape[0]:
            raise InputError(f"relevance of shape {tuple(relevance.shape)} and scores of shape {tuple(scores.shape)} "
                             "differ in batch size; pass one score per example (relevance (B, ...), scores (B,)).")
        require_nonempty_batch(scores.shape[0])
        require_finite("relevance", relevance)
        require_finite("scores", scores)
        totals = relevance.detach().to(device="cpu", dtype=torch.float64).reshape(relevance.shape[0], -1).sum(dim=1)
        scores = scores.detach().to(device="cpu", dtype=torch.float64)
        errors = (totals - scores).abs()
        if self.relative:
            if bool((scores == 0).any()):
                raise InputError("A score of exactly 0 makes the relative completeness error undefined (division by "
                                 "|score|). Use CompletenessError(relative=False) or leave those examples out.")
            errors = errors / scores.abs()
        self._check_range(errors, totals, scores)
        self._add("error_sum", exact_sum(errors))
        self._add("count", torch.tensor(errors.numel()))
        self._add("above_tolerance", (errors > self.tolerance).sum())
        self._add("histogram", torch.bincount(error_bins(errors), minlength=_BINS))

    def _check_range(self, errors: torch.Tensor, totals: torch.Tensor, scores: torch.Tensor) -> None:
        """Errors from 2**22 up fit neither the exact sums nor the histogram: name the example instead."""
        too_large = (errors >= 2.0 ** _HIGHEST_EXPONENT).nonzero().flatten()
        if too_large.numel() == 0:
            return
        i = int(too_large[0])
        if self.relative:
            raise InputError(
                f"Example {i} of the batch has score {float(scores[i]):.3g} and relevance sum {float(totals[i]):.3g}: "
                f"the relative error {float(errors[i]):.3g} exceeds {2.0 ** _HIGHEST_EXPONENT:.3g}, as a score near 0 "
                "makes it explode. Use CompletenessError(relative=False) for scores near 0, or leave such examples out.")
        raise InputError(
            f"Example {i} of the batch has relevance sum {float(totals[i]):.3g} for score {float(scores[i]):.3g}: "
            f"the error {float(errors[i]):.3g} exceeds {2.0 ** _HIGHEST_EXPONENT:.3g}. Check that the relevance "
            "explains this score (same example, class and scale).")

    def compute(self) -> CompletenessResult:
        n = int(self._state["count"].item())
        filled = torch.nonzero(self._state["histogram"]).flatten()
        return CompletenessResult(
            name="completeness_error", mean_error=float(self._value("error_sum")) / n if n else math.nan,
            max_error=bin_upper_edge(int(filled.max())) if n else math.nan, count=n,
            above_tolerance=int(self._state["above_tolerance"].item()), tolerance=self.tolerance,
            relative=self.relative,
        )
