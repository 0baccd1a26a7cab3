r"""Percentile bootstrap intervals of a mean over examples, and the result record that holds one.

Efron's percentile bootstrap (Efron and Tibshirani, "An Introduction to the Bootstrap", 1993,
ch. 13): draw ``resamples`` sets of ``n`` examples with replacement from the ``n`` per-example
values :math:`v_i`, take each set's mean :math:`\bar v^{*b}`, and report the
:math:`(1-\text{level})/2` and :math:`(1+\text{level})/2` quantiles of those means (linear
interpolation between order statistics, NumPy's default) around the plain mean
:math:`\bar v`. All resamples are drawn at once from a seeded ``torch.Generator``, so the
interval is the same on every run and costs one (resamples, n) gather.

Example::

    >>> interval = bootstrap_interval(torch.tensor([1.0, 1.0, 0.0, 1.0]), name="top1_value")
    >>> interval.value, interval.count
    (0.75, 4)
    >>> interval.text
    '0.750 [0.250, 1.000]'
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError
from ..evaluation.results import ResultRecord

BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_SEED = 0
BOOTSTRAP_LEVEL = 0.95


@dataclass(frozen=True)
class IntervalResult(ResultRecord):
    """A mean over ``count`` examples with its percentile bootstrap interval ``[low, high]``.

    ``excluded`` examples had no value (e.g. a relevance share of a map with no positive
    relevance) and were left out of the mean and the resamples.
    """

    name: str
    value: float
    low: float
    high: float
    count: int
    excluded: int = 0
    level: float = BOOTSTRAP_LEVEL
    resamples: int = BOOTSTRAP_RESAMPLES
    seed: int = BOOTSTRAP_SEED

    @property
    def text(self) -> str:
        """``"mean [low, high]"`` with three decimals, for tables."""
        return f"{self.value:.3f} [{self.low:.3f}, {self.high:.3f}]"


def bootstrap_interval(values, name: str = "mean", resamples: int = BOOTSTRAP_RESAMPLES,
                       seed: int = BOOTSTRAP_SEED, level: float = BOOTSTRAP_LEVEL) -> IntervalResult:
    """The mean of the finite ``values`` (one per example) and its percentile bootstrap interval.

    NaN entries (examples without a value) are left out and counted as ``excluded``; with no
    value left the mean and bounds are NaN (never a silent 0). Infinite values are refused.

    Example::

        >>> bootstrap_interval([0.0, 1.0]).text     # resample means 0, 0.5, 1 with chance 1/4, 1/2, 1/4
        '0.500 [0.000, 1.000]'
    """
    values = torch.as_tensor(values).detach().to(device="cpu", dtype=torch.float64).reshape(-1)
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise InputError(f"resamples must be a positive int, received {resamples!r}.")
    if not 0.0 < level < 1.0:
        raise InputError(f"level must lie in (0, 1) (e.g. 0.95 for a 95 % interval), received {level!r}.")
    if torch.isinf(values).any():
        raise InputError(f"values hold {int(torch.isinf(values).sum())} infinite entries; a bootstrap mean of "
                         "them is undefined. Pass finite per-example values (NaN marks an example without one).")
    kept = values[~torch.isnan(values)]
    excluded = values.numel() - kept.numel()
    if kept.numel() == 0:
        nan = float("nan")
        return IntervalResult(name, nan, nan, nan, 0, excluded, level, resamples, seed)
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(kept.numel(), (resamples, kept.numel()), generator=generator)
    means = kept[picks].mean(dim=1)
    tail = (1.0 - level) / 2.0
    low, high = torch.quantile(means, torch.tensor([tail, 1.0 - tail], dtype=torch.float64)).tolist()
    return IntervalResult(name, float(kept.mean()), low, high, kept.numel(), excluded, level, resamples, seed)


__all__ = ["BOOTSTRAP_LEVEL", "BOOTSTRAP_RESAMPLES", "BOOTSTRAP_SEED", "IntervalResult", "bootstrap_interval"]
