"""From accumulated per-step sums to a ``CurveResult``: the mean curve and its trapezoid area."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .results import CurveResult


def trapezoid(y: Sequence[float], x: Sequence[float]) -> float:
    """Area under ``y(x)`` by the trapezoid rule, ``sum_i (x[i+1]-x[i]) (y[i]+y[i+1]) / 2``.

    >>> trapezoid([1.0, 1.0, 0.0], [0.0, 0.5, 1.0])
    0.75
    """
    return float(np.trapezoid(np.asarray(y, dtype=np.float64), np.asarray(x, dtype=np.float64)))


def mean_curve(
    name: str,
    x: Sequence[float],
    sums: torch.Tensor,
    count: torch.Tensor,
    *,
    auc_scale: float = 1.0,
    higher_is_better: bool = True,
    y_label: str = "",
    x_label: str = "fraction",
) -> CurveResult:
    """``y = sums / count`` per step and ``auc = auc_scale * trapezoid(y, x)``.

    With no examples seen, ``y`` and ``auc`` are NaN and ``count`` is 0 (never a silent 0).
    """
    n = int(count.item())
    y = (sums / n).tolist() if n else [float("nan")] * len(x)
    return CurveResult(
        name=name, x=tuple(float(v) for v in x), y=tuple(y), auc=auc_scale * trapezoid(y, x), count=n,
        auc_scale=auc_scale, higher_is_better=higher_is_better, x_label=x_label, y_label=y_label,
    )
