"""The aggregate curves of a benchmark's ``results.json``, drawn on the classifier page beside
the per-example ones (``explore --results``; ``GET /api/benchmark`` answers them).

Example::

    >>> curves = benchmark_curves("runs/digits/results.json")
    >>> curves["metrics"]                    # {metric: {method: {"x", "y", "auc", ...}}}
"""
from __future__ import annotations

import json
from typing import Any, Dict

from ....errors import InputError
from ...http import shown


def benchmark_curves(path) -> Dict[str, Any]:
    """The curves of a benchmark's ``results.json`` by metric and method, for the page."""
    from ....evaluation.results import CurveResult, read_json

    expected = ('expected the results.json of `captum-transformers benchmark`: a JSON list of objects '
                '{"method": "<name>", "kind": "<result kind>", ...}')
    try:
        with open(path) as handle:
            payload = json.load(handle)
    except (OSError, ValueError) as error:
        raise InputError(f"--results {str(path)!r} is not a readable results.json of `captum-transformers benchmark` "
                         f"({type(error).__name__}: {error}).") from None
    if not isinstance(payload, list):
        raise InputError(f"--results {str(path)!r} holds a JSON {type(payload).__name__}; {expected}.")
    for number, entry in enumerate(payload):
        if not isinstance(entry, dict) or not isinstance(entry.get("method"), str) \
                or not isinstance(entry.get("kind"), str):
            raise InputError(f"--results {str(path)!r}: entry {number} is {shown(entry)}; {expected}.")
    try:
        rows = read_json(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise InputError(f"--results {str(path)!r} is not a readable results.json of `captum-transformers benchmark` "
                         f"({type(error).__name__}: {error}); {expected}.") from None
    metrics: Dict[str, Dict[str, Any]] = {}
    for method, result in rows:
        if isinstance(result, CurveResult):
            metrics.setdefault(result.name, {})[method] = {
                "x": list(result.x), "y": list(result.y), "auc": result.auc, "count": result.count,
                "higher_is_better": result.higher_is_better, "x_label": result.x_label, "y_label": result.y_label}
    if not metrics:
        raise InputError(f"--results {str(path)!r} holds no curve results; expected the results.json of an image "
                         "or token benchmark.")
    return {"source": str(path), "metrics": metrics}
