"""Frozen result records of the metrics and their JSON / CSV serialisation.

Every result has a ``name`` (the metric, e.g. ``"perturbation_positive"``), ``to_dict()``
(JSON-ready, with a ``"kind"`` key naming the class) and ``to_json(path)``. A benchmark
collects ``(method, result)`` rows and writes them with ``write_json`` (everything, curves
included) or ``write_csv`` (one row per method and metric, scalar fields only: curve arrays
do not fit a CSV cell, the JSON file keeps them).

>>> row = ("rollout", CurveResult("auac", (0.0, 1.0), (0.2, 0.8), 0.5, 3))
>>> write_json([row], "results.json"); read_json("results.json") == [row]   # doctest: +SKIP
True
"""
from __future__ import annotations

import csv
import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Tuple

from ..errors import InputError


RESULT_KINDS: Dict[str, type] = {}
"""Every result class by name, for ``result_from_dict``: a subclass of ``ResultRecord`` registers itself."""


class ResultRecord:
    """Serialisation shared by the result dataclasses (each subclass is registered in ``RESULT_KINDS``)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        RESULT_KINDS[cls.__name__] = cls

    def to_dict(self) -> Dict[str, Any]:
        """Fields as JSON-ready Python values, plus ``"kind"``: the class name."""
        out: Dict[str, Any] = {"kind": type(self).__name__}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            out[field.name] = list(value) if isinstance(value, tuple) else value
        return out

    def to_json(self, path) -> None:
        """Write ``to_dict()`` to ``path`` as JSON."""
        with open(path, "w") as handle:
            json.dump(self.to_dict(), handle, indent=2)

    def scalars(self) -> Dict[str, Any]:
        """The fields that fit one CSV cell (everything but the curve arrays)."""
        return {k: v for k, v in self.to_dict().items() if not isinstance(v, list) and k != "kind"}

    @classmethod
    def from_dict(cls, data: Dict[str, Any]):
        """Inverse of ``to_dict`` (the ``"kind"`` key is ignored)."""
        values = {}
        for field in dataclasses.fields(cls):
            value = data[field.name]
            values[field.name] = tuple(value) if isinstance(value, list) else value
        return cls(**values)


@dataclass(frozen=True)
class CurveResult(ResultRecord):
    """A perturbation curve: ``y[i]`` measured at ``x[i]``, its area and how it was scaled.

    ``auc = auc_scale * trapezoid(y, x)``; ``higher_is_better`` says which way a better
    explanation moves it (e.g. False for positive perturbation and AU-MSE).
    """

    name: str
    x: Tuple[float, ...]
    y: Tuple[float, ...]
    auc: float
    count: int
    auc_scale: float = 1.0
    higher_is_better: bool = True
    x_label: str = "fraction"
    y_label: str = ""


@dataclass(frozen=True)
class SegmentationResult(ResultRecord):
    """Chefer et al. (CVPR'21) segmentation scores: pixel accuracy, IoU per class, mIoU, mAP."""

    name: str
    pixel_accuracy: float
    iou_background: float
    iou_foreground: float
    miou: float
    mean_ap: float
    count: int


@dataclass(frozen=True)
class RationaleF1Result(ResultRecord):
    """ERASER token-level agreement with gold rationales (macro and micro F1)."""

    name: str
    macro_f1: float
    micro_f1: float
    micro_precision: float
    micro_recall: float
    count: int


@dataclass(frozen=True)
class SpecificityResult(ResultRecord):
    """Class specificity: mean share of positive relevance on the explained object.

    ``count`` directions entered the mean; ``excluded`` had no positive relevance on either
    object (their share is undefined) and were left out.
    """

    name: str
    specificity: float
    count: int
    excluded: int


@dataclass(frozen=True)
class ScalarResult(ResultRecord):
    """One number averaged over ``count`` examples (node AUROC, a fidelity)."""

    name: str
    value: float
    count: int


Row = Tuple[str, ResultRecord]


def result_from_dict(data: Dict[str, Any]) -> ResultRecord:
    """Rebuild a result from ``to_dict()`` output, using its ``"kind"``."""
    kind = data.get("kind")
    if kind not in RESULT_KINDS:
        raise InputError(f"Unknown result kind {kind!r}; expected one of {sorted(RESULT_KINDS)}.")
    return RESULT_KINDS[kind].from_dict(data)


def _check_rows(rows: Iterable[Row]) -> List[Row]:
    rows = list(rows)
    for row in rows:
        is_pair = isinstance(row, tuple) and len(row) == 2
        if not (is_pair and isinstance(row[0], str) and isinstance(row[1], ResultRecord)):
            raise InputError(
                f"Each row must be a (method_name, result) pair, got {row!r}. "
                "Collect rows as [(\"rollout\", metric.compute()), ...]."
            )
    return rows


def write_json(rows: Iterable[Row], path) -> None:
    """Write ``(method, result)`` rows as a JSON list of ``{"method": ..., **result.to_dict()}``."""
    payload = [{"method": method, **result.to_dict()} for method, result in _check_rows(rows)]
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=2)


def read_json(path) -> List[Row]:
    """Inverse of ``write_json``."""
    with open(path) as handle:
        payload = json.load(handle)
    return [(entry.pop("method"), result_from_dict(entry)) for entry in payload]


def write_csv(rows: Iterable[Row], path) -> None:
    """One CSV row per (method, metric): ``method, kind, name`` and the union of scalar fields.

    Fields a result does not have are left empty; curve arrays are omitted (see ``write_json``).
    """
    rows = _check_rows(rows)
    records = [{"method": method, "kind": type(result).__name__, **result.scalars()} for method, result in rows]
    columns: List[str] = []
    for record in records:
        columns.extend(k for k in record if k not in columns)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(records)


def read_csv(path) -> List[Dict[str, Any]]:
    """Rows of a ``write_csv`` file as dicts; numbers parsed back, empty cells dropped."""

    def parse(text: str):
        if text in ("True", "False"):
            return text == "True"
        for kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                pass
        return text

    with open(path, newline="") as handle:
        return [{k: parse(v) for k, v in row.items() if v != ""} for row in csv.DictReader(handle)]

