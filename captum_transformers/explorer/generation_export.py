"""The generation page's view as one self-contained HTML file (no script, no network).

Per method a table with one row per generated token ``y_t``: the token, its explained score
and first-token share, then the prompt and the earlier output coloured by row ``t`` of
``token_attr`` and ``target_attr`` (what the page shows when ``y_t`` is clicked). Colours are
the page's: each row scaled by its largest absolute value; signed methods blue (against),
white (0), red (for); unsigned ones white to red (more relevant, no direction). Every string
(tokens, prompt, method and model names) is HTML-escaped.

Example::

    >>> html = generation_html("recall Llama", {"attn-lrp": workspace.explain("attn-lrp", {}, {0: request})[0]})
    >>> open("generation.html", "w").write(html)
"""
from __future__ import annotations

import html
from typing import Any, Dict, List, Mapping

import torch

from .export import diverging


def _values(entry: Any) -> Any:
    """The nested lists of one of ``result_to_dict``'s arrays (non-finite names as NaN)."""
    values = entry["values"] if isinstance(entry, dict) else entry

    def number(v):
        return [number(x) for x in v] if isinstance(v, list) else (float("nan") if isinstance(v, str) else float(v))

    return number(values)


def _chips(tokens: List[str], scores: List[float], scale: float, css: str) -> str:
    colours = diverging(torch.tensor(scores, dtype=torch.float64) / scale).tolist() if scores else []
    spans = []
    for token, score, colour in zip(tokens, scores, colours):
        rgb = ",".join(str(round(c * 255)) for c in colour)
        spans.append(f'<span title="{score:.4g}" style="background:rgb({rgb});{css}">{html.escape(token)}</span>')
    return "".join(spans)


def _method_table(method: str, payload: Mapping[str, Any]) -> str:
    inputs, outputs = payload["input_tokens"], payload["output_tokens"]
    token_attr, target_attr = _values(payload["token_attr"]), _values(payload["target_attr"])
    scores, shares = _values(payload["scores"]), _values(payload["first_token_share"])
    css = "padding:1px 3px;margin:1px;border-radius:2px;display:inline-block"
    note = ("signed: red = for the token, blue = against" if payload.get("signed")
            else "unsigned: darker red = more relevant, no direction")
    rows = [f"<tr><th colspan=\"4\" style=\"text-align:left\">{html.escape(method)} "
            f"<small>({html.escape(str(payload.get('method', '')))}, {html.escape(str(payload.get('score_kind', '')))}"
            f"; {note})</small></th></tr>",
            "<tr><th>token</th><th>score</th><th>first-token share</th><th>evidence: prompt | earlier output</th></tr>"]
    for t, token in enumerate(outputs):
        prompt_row, earlier = token_attr[t], target_attr[t][:t]
        scale = max([abs(v) for v in prompt_row + earlier if v == v] + [0.0]) or 1.0
        evidence = (_chips(inputs, prompt_row, scale, css) + ' <b>|</b> '
                    + _chips(payload["target_attr_tokens"][:t], earlier, scale, css))
        rows.append(f"<tr><td><b>{html.escape(token)}</b></td><td>{scores[t]:.4g}</td><td>{shares[t]:.3f}</td>"
                    f"<td>{evidence}</td></tr>")
    return "<table style=\"border-collapse:collapse;margin-bottom:14px\" border=\"1\" cellpadding=\"4\">" + \
        "".join(rows) + "</table>"


def generation_html(model: str, results: Mapping[str, Mapping[str, Any]]) -> str:
    """``results`` (method name -> the page's payload of one request) as one HTML document."""
    first: Dict[str, Any] = next(iter(results.values()), {})
    request = first.get("request", {})
    title = html.escape(f"captum_transformers generation: {model}")
    prompt = html.escape(str(request.get("prompt", "")))
    answer = html.escape(" ".join(first.get("output_tokens", [])))
    tables = "".join(_method_table(method, payload) for method, payload in results.items())
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>" + title + "</title></head>"
            "<body style=\"font:12px sans-serif\"><h3>" + title + "</h3>"
            f"<p>prompt: <code>{prompt}</code><br>greedy answer: <code>{answer}</code></p>"
            "<p>Each row explains one generated token: its evidence in the prompt and in the output before it, "
            "scaled by the row's largest absolute value. The first-token share is the part of the row's absolute "
            "attribution on the first token (attention sinks show a large share).</p>" + tables + "</body></html>")
