"""Buffers and products of the chunked attention backward pass (attention_core's row chunks).

A chunk of query rows makes (B, H, c, K) tensors: the scores, the gradient at the map and at the
scores. Made fresh for every chunk, each costs a page fault per 4 KiB wherever freed memory goes back
to the system (glibc with low mmap thresholds: up to half the backward pass's time on a 2k-token
Llama), so :class:`ChunkBuffers` keeps one buffer per tensor for a whole call. :func:`add_product`
sums ``g_V`` and ``g_K`` in place. Under grouped-query attention (:func:`kv_groups`) the G heads that
read the same key and value head run as one product with their rows stacked (:func:`grouped`): each
key is read once per group, and the products are G times taller (about 25 % less time for the five
products at 4k tokens, 8 heads in 2 groups). :func:`map_gradient` is the gradient at a chunk's map.
(The chunks' sizes: :mod:`captum_transformers.capture.row_chunks`.)

Example::

    >>> buffers = ChunkBuffers()
    >>> scores = buffers.take(0, (1, 8, 32, 4096), query)   # the same memory for every chunk
"""
from __future__ import annotations

from typing import Optional

import torch


def kv_groups(scores_fn, plain_gradient, query, key, value, g_output) -> int:
    """``G`` where the scores function says (``kv_groups``) that ``key`` and ``value`` repeat each
    of H / G heads G times (grouped-query attention, the heads ``h`` of a group ``h // G``) and
    are used nowhere else, and the operands allow it: the chunks' products then run once per
    group with its G heads' rows stacked (one product of G c rows instead of G of c rows, each key
    read once), and ``g_K``, ``g_V`` are summed over each group. 1 otherwise."""
    groups = getattr(scores_fn, "kv_groups", 1)
    if groups <= 1 or not getattr(plain_gradient, "accumulates", False) or query.dim() != 4 \
            or not (query.shape[:2] == key.shape[:2] == value.shape[:2] == g_output.shape[:2]) \
            or query.shape[1] % groups:
        return 1
    return groups


def repeat_heads(states: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, H / G, N, d) keys or values as (B, H, N, d), each head repeated G times in a row: the
    heads ``h`` of group ``h // G`` read the same one (grouped-query attention; transformers'
    ``repeat_kv``)."""
    if groups == 1:
        return states
    batch, heads, length, dim = states.shape
    return states[:, :, None].expand(batch, heads, groups, length, dim).reshape(batch, heads * groups, length, dim)


def model_heads(gradient: Optional[torch.Tensor], groups: int) -> Optional[torch.Tensor]:
    """The gradient of the H / G heads that :func:`repeat_heads` repeated, from that of the H
    repeated heads (B, H, N, d): each group's G heads summed, as the repetition's backward pass sums them."""
    if gradient is None or groups == 1:
        return gradient
    batch, heads, length, dim = gradient.shape
    return gradient.view(batch, heads // groups, groups, length, dim).sum(2)


def grouped(tensor: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, H, c, n) as (B, H / G, G c, n): each group's heads' rows stacked (a view where it can be)."""
    if groups == 1:
        return tensor
    return tensor.reshape(tensor.shape[0], tensor.shape[1] // groups, groups * tensor.shape[2], tensor.shape[3])


def group_zeros(like: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient accumulator of ``like`` (B, H, N, d): per group (B, H / G, N, d) when ``groups > 1``."""
    if groups == 1:
        return torch.zeros_like(like)
    return like.new_zeros(like.shape[0], like.shape[1] // groups, *like.shape[2:])


def group_gradient(summed: torch.Tensor, like: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of the repeated heads ``like`` (B, H, N, d) from each group's sum (B, H / G, N, d):
    the sum in the group's first head, zeros in the others. The model's heads get exactly the sums
    (the repetition's backward pass adds a group's heads: ``x + 0 = x``)."""
    if groups == 1:
        return summed
    heads = like.new_zeros(like.shape[0], like.shape[1] // groups, groups, *like.shape[2:])
    heads[:, :, 0] = summed
    return heads.view(like.shape)


class ChunkBuffers:
    """Buffers reused by the chunks of one call: :meth:`take` gives a contiguous tensor of a
    shape, dtype and device, a view of the buffer of that slot (made, or grown, when too small)."""

    def __init__(self) -> None:
        self._flat = {}

    def take(self, slot: int, shape, like: torch.Tensor) -> torch.Tensor:
        numel = 1
        for size in shape:
            numel *= size
        flat = self._flat.get(slot)
        if flat is None or flat.numel() < numel or flat.dtype != like.dtype or flat.device != like.device:
            flat = self._flat[slot] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return flat[:numel].view(shape)


def add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``out += alpha a @ b`` for (B, H, M, K) and (B, H, K, N) operands into (B, H, M, N): in
    ``out``'s own buffer (``baddbmm_``, no product tensor) where its heads fold into one batch,
    else by a product and an in-place sum. The same sum to rounding."""
    folds = out.dim() == 4 and a.shape[:2] == b.shape[:2] == out.shape[:2] and a.dtype == b.dtype == out.dtype \
        and (out.shape[0] == 1 or out.stride(0) == out.shape[1] * out.stride(1))
    if not folds or torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return out.add_(torch.matmul(a, b), alpha=alpha)
    merged = out.shape[0] * out.shape[1]
    out.view(merged, *out.shape[2:]).baddbmm_(a.reshape(merged, *a.shape[2:]), b.reshape(merged, *b.shape[2:]),
                                              alpha=alpha)
    return out


def halves_map_gradient(ctx) -> bool:
    """Whether the uniform product rule halves the gradient at the map (``g_A = g_O V^T / 2``):
    the forward ran under operation rules whose matmul rule is "uniform" and both operands of
    ``A V`` carry relevance (``ctx`` of the attention Function)."""
    return ctx.mode is not None and ctx.mode.rules.matmul == "uniform" and ctx.both_operands


def map_gradient(value, g_output, g_probs_outside, halved: bool) -> torch.Tensor:
    """The gradient at ``A`` of ``O = A V`` (halved under the uniform rule, exactly as the
    product's rule Function computes it), plus whatever reached ``A`` from outside the
    product (a model that also uses its attention weights)."""
    g_probs = torch.matmul(g_output, value.transpose(-1, -2))
    if halved:
        g_probs.mul_(0.5)
    if g_probs_outside is not None:
        g_probs.add_(g_probs_outside)
    return g_probs
