"""The generation page's view as one self-contained HTML file (no script, no network).

The page's results (``result_to_dict`` dicts) are read back into ``GenerationResult``s and
drawn with the package's own view, ``visualization.generation_report``: per method a
``GenerationMatrix``, one row per generated token ``y_t`` (its probability and first-token
share beside it), one column per token it could read, the prompt's (``token_attr[t]``) then
the earlier output's (``target_attr[t]``): what the page colours when ``y_t`` is clicked.
Colours follow the package's convention (signed methods blue-white-red on a symmetric scale,
unsigned ones white to red), with the legend; every string is escaped by the view.

Example::

    >>> html = generation_html("recall Llama", {"attn-lrp": workspace.explain("attn-lrp", {}, {0: request})[0]})
    >>> open("generation.html", "w").write(html)
"""
from __future__ import annotations

from typing import Any, Mapping


def generation_html(model: str, results: Mapping[str, Mapping[str, Any]]) -> str:
    """``results`` (method name -> the page's payload of one request) as one HTML document."""
    from ....generation.serialization import result_from_dict
    from ....visualization import generation_report

    first = next(iter(results.values()), {})
    prompt = first.get("request", {}).get("prompt", "")
    title = f"{model}: why each token of the answer to {prompt!r} was generated"
    read = {method: result_from_dict(payload) for method, payload in results.items()}
    return generation_report(read, title=title).to_html(standalone=True)
