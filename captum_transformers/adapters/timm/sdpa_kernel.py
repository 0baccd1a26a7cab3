"""``F.scaled_dot_product_attention`` run as an explicit softmax attention that can be observed.

A module that calls SDPA (timm's attention with ``fused_attn=True``) computes its map inside
one fused kernel: no map to record, no softmax or product for the LRP rules to act on.
Inside :func:`explicit_sdpa` the module's forward runs under a ``TorchFunctionMode`` that
replaces each SDPA call by :func:`~captum_transformers.propagation.attention.core.softmax_attention`:

.. math:: O = \\mathrm{softmax}\\big((Q \\cdot s) K^\\top + \\mathrm{bias}\\big) V

with SDPA's semantics (``scale`` default ``d^{-1/2}``, a boolean ``attn_mask`` True where a
key takes part, ``is_causal``, ``enable_gqa``) and, operation for operation, the explicit path
timm writes next to it (``q * scale``, ``q @ k^T``, the additive bias, ``softmax``, ``@ v``),
so outputs equal that path's bit for bit. Like a fused kernel it keeps only Q, K and V for the
backward pass; the map reaches the recorder through the callback.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ...model_state import patching
from ...propagation.attention.core import softmax_attention
from ...propagation.attention.head_products import heads_matmul
from ...capture.recorder import SiteObserver

# Called with the map (B, H, Q, K) and the observer that will report its gradient.
Report = Callable[[torch.Tensor, Optional[SiteObserver]], None]


def _with_mask(scores: torch.Tensor, mask: Optional[torch.Tensor], is_causal: bool) -> torch.Tensor:
    """SDPA's mask applied to the scores as timm's explicit path applies its additive bias
    (0 or -inf where a boolean mask is False; a float mask added; ``is_causal``: the upper
    triangle), built from the caller's mask inside the scores, so no per-layer bias is kept."""
    if is_causal:
        return scores + scores.new_full(scores.shape[-2:], float("-inf")).triu_(1)
    if mask is None:
        return scores
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, float("-inf"))
    return scores + mask


def sdpa_as_softmax_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                              is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False,
                              *, report: Optional[Report] = None) -> torch.Tensor:
    """What ``F.scaled_dot_product_attention`` computes, as an explicit softmax attention
    whose map is handed to ``report``. Attention dropout (``dropout_p > 0``, training) is
    applied to the map after it is reported, outside the fused Function."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
    extras = () if attn_mask is None or is_causal else (attn_mask,)

    def scores(query: torch.Tensor, key: torch.Tensor, *mask: torch.Tensor) -> torch.Tensor:
        return _with_mask(heads_matmul(query * scale, key.transpose(-2, -1)), mask[0] if mask else None, is_causal)

    def plain_gradient(g_scores: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        """``S = (scale Q) K^T`` differentiated by hand (see attention_core)."""
        return torch.matmul(g_scores, key).mul_(scale), torch.matmul(g_scores.transpose(-1, -2), query * scale)

    scores.plain_gradient = plain_gradient
    scores.batch_sliceable = True  # reads nothing per example but its arguments
    scores.row_sliceable = not is_causal  # the causal triangle is made for the whole map's rows

    if dropout_p > 0.0:
        probs = torch.softmax(scores(query, key, *extras), dim=-1)
        if report is not None:
            report(probs, None)
        return F.dropout(probs, p=dropout_p, training=True) @ value
    observer = SiteObserver() if report is not None else None
    output, probs = softmax_attention(scores, query, key, value, *extras, observer=observer)
    if report is not None:
        report(probs, observer)
    return output


class _ExplicitSdpa(TorchFunctionMode):
    def __init__(self, reports: List[Optional[Report]]):
        super().__init__()
        self.reports = reports

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return sdpa_as_softmax_attention(*args, **kwargs, report=self._report)
        return func(*args, **kwargs)

    def _report(self, probs: torch.Tensor, observer: Optional[SiteObserver]) -> None:
        for report in self.reports:
            if report is not None:
                report(probs, observer)


# Modules whose forward runs SDPA explicitly now -> the reports of every context asking for it
# (a capture and a propagation may both be entered, in either order: one interception serves both).
_REPORTS: Dict[int, List[Optional[Report]]] = {}


@contextlib.contextmanager
def explicit_sdpa(module: nn.Module, report: Optional[Report] = None) -> Iterator[None]:
    """While inside, SDPA calls made by ``module``'s forward run as an explicit softmax
    attention (reversibly: an instance forward). ``report(probs, observer)`` receives each
    call's map; under the LRP rules the products and softmax follow them. Nested contexts on
    one module share one interception and every report is called.

    Example::

        >>> with explicit_sdpa(vit.blocks[0].attn, lambda probs, observer: maps.append(probs)):
        ...     vit(images)
    """
    reports = _REPORTS.get(id(module))
    if reports is not None:  # already intercepted by an enclosing context: add this report
        reports.append(report)
        try:
            yield
        finally:
            reports.remove(report)
        return
    reports = _REPORTS[id(module)] = [report]

    def wrap(original):
        def forward(*args, **kwargs):
            with _ExplicitSdpa(reports):
                return original(*args, **kwargs)
        return forward

    try:
        with patching.instance_forward(module, wrap):
            yield
    finally:
        del _REPORTS[id(module)]
