"""Models the package ships: a Graphormer with transformers 4.x's state-dict names, and its
collator. Imported on first use, so ``import captum_transformers`` needs no transformers.

Example::

    >>> from captum_transformers.models import GraphormerCollator, GraphormerForGraphClassification
"""
from __future__ import annotations

_EXPORTS = {
    "GraphormerConfig": "graphormer", "GraphormerModel": "graphormer", "GraphormerForGraphClassification": "graphormer",
    "GraphormerPreTrainedModel": "graphormer", "GraphormerCollator": "graph_collator",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
