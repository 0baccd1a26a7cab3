"""``F.scaled_dot_product_attention`` run as an explicit softmax attention that can be observed.

A module that calls SDPA (timm's attention with ``fused_attn=True``) computes its map inside
one fused kernel: no map to record, no softmax or product for the LRP rules to act on.
Inside :func:`explicit_sdpa` the module's forward runs under a ``TorchFunctionMode`` that
replaces each SDPA call by :func:`~captum_transformers.attention_core.softmax_attention`:

.. math:: O = \\mathrm{softmax}\\big((Q \\cdot s) K^\\top + \\mathrm{bias}\\big) V

with SDPA's semantics (``scale`` default ``d^{-1/2}``, a boolean ``attn_mask`` True where a
key takes part, ``is_causal``, ``enable_gqa``) and, operation for operation, the explicit path
timm writes next to it (``q * scale``, ``q @ k^T``, the additive bias, ``softmax``, ``@ v``),
so outputs equal that path's bit for bit. Like a fused kernel it keeps only Q, K and V for the
backward pass; the map reaches the recorder through the callback.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .. import patching
from ..attention_core import softmax_attention
from .recorder import SiteObserver

# Called with the map (B, H, Q, K) and the observer that will report its gradient.
Report = Callable[[torch.Tensor, Optional[SiteObserver]], None]


def _additive_bias(query: torch.Tensor, key: torch.Tensor, attn_mask: Optional[torch.Tensor],
                   is_causal: bool) -> Optional[torch.Tensor]:
    """SDPA's mask as an additive bias in the query's dtype (as timm's explicit path builds it)."""
    if is_causal:
        return query.new_full((query.shape[-2], key.shape[-2]), float("-inf")).triu_(1)
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        return torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(~attn_mask, float("-inf"))
    return attn_mask


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
    bias = _additive_bias(query, key, attn_mask, is_causal)
    extras = () if bias is None else (bias,)

    def scores(query: torch.Tensor, key: torch.Tensor, *bias: torch.Tensor) -> torch.Tensor:
        scores = (query * scale) @ key.transpose(-2, -1)
        return scores + bias[0] if bias else scores

    if dropout_p > 0.0:
        probs = torch.softmax(scores(query, key, *extras), dim=-1)
        if report is not None:
            report(probs, None)
        return F.dropout(probs, p=dropout_p, training=True) @ value
    observer = SiteObserver() if report is not None else None
    output, probs = softmax_attention(scores, query, key, value, *extras, observer=observer)
    if report is not None:  # a map outside the graph is recorded as such (and refused if a gradient is needed)
        report(probs, observer if probs.requires_grad else None)
    return output


class _ExplicitSdpa(TorchFunctionMode):
    def __init__(self, report: Optional[Report]):
        super().__init__()
        self.report = report

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return sdpa_as_softmax_attention(*args, **kwargs, report=self.report)
        return func(*args, **kwargs)


@contextlib.contextmanager
def explicit_sdpa(module: nn.Module, report: Optional[Report] = None) -> Iterator[None]:
    """While inside, SDPA calls made by ``module``'s forward run as an explicit softmax
    attention (reversibly: an instance forward). ``report(probs, observer)`` receives each
    call's map; under the LRP rules the products and softmax follow them.

    Example::

        >>> with explicit_sdpa(vit.blocks[0].attn, lambda probs, observer: maps.append(probs)):
        ...     vit(images)
    """
    def wrap(original):
        def forward(*args, **kwargs):
            with _ExplicitSdpa(report):
                return original(*args, **kwargs)
        return forward

    with patching.instance_forward(module, wrap):
        yield
