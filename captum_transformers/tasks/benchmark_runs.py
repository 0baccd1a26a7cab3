"""What every benchmark run shares: its report, this process's place among the processes, and
a progress bar.

:class:`BenchmarkReport` holds the rows of one run (:func:`.runner.run_benchmark`, or
:func:`.recall.benchmark.run_recall_benchmark` for the recall task); :func:`rank_and_world_size` gives
this process's rank and the number of processes; :func:`progress_bar` wraps an iterable in a tqdm bar
when asked and tqdm is installed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..evaluation.results import ResultRecord


@dataclass(frozen=True)
class BenchmarkReport:
    """Every (method, metric result) row of one run, and how the run was made."""

    task: str
    methods: Tuple[str, ...]
    rows: Tuple[Tuple[str, ResultRecord], ...]
    examples: int
    world_size: int
    seconds: float
    explained: str
    pixel_steps: Optional[str] = None  # the digits task's perturbation protocol; None for other tasks
    metrics: str = "classic"  # the metric set (tasks.extended_metrics.METRIC_SETS)

    def result(self, method: str, metric: str) -> ResultRecord:
        for row_method, result in self.rows:
            if row_method == method and result.name == metric:
                return result
        raise KeyError((method, metric))


def progress_bar(iterable, total: int, description: str, enabled: bool):
    """``iterable`` under a tqdm progress bar labelled ``description`` where ``enabled`` and tqdm
    is installed, else ``iterable`` itself."""
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=description, leave=False)


def rank_and_world_size() -> Tuple[int, int]:
    """``(rank, world_size)`` of this process in the initialised ``torch.distributed`` group, else ``(0, 1)``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1
