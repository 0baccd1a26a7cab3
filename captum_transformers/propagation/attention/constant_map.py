r"""Attention whose map is held constant (the AH rule), differentiated with respect to V only.

Under the AH rule of Ali et al. (ICML 2022) the map is a constant gate, ``O = [A]_const V``,
so the backward pass needs only

.. math:: g_V = A^\top g_O, \qquad A = \mathrm{softmax}(s\,Q K^\top + M),

one product for the scores and one for ``g_V`` per layer. A fused kernel run over detached
queries and keys (``propagation/fused_attention``) gets the same ``g_V`` but its backward pass
computes all of ``dQ``, ``dK`` and ``dV`` (five products). Here the forward is the model's own
fused call, unchanged, and the backward recomputes ``A`` in blocks of query rows, so its
temporaries stay near ``_BLOCK_ELEMENTS`` whatever the sequence length (no (B, H, Q, K)
tensor is kept or made whole).
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

from ...capture.row_chunks import chunk_budget

# Elements of one block of recomputed scores on a CPU (4 MiB in float32; larger on an accelerator).
_BLOCK_ELEMENTS = 1 << 20


class _ConstantMapAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value, run, query, key, mask, scale):
        with torch.no_grad():
            output = run(value.detach())
        ctx.save_for_backward(query, key, *(() if mask is None else (mask,)))
        ctx.scale, ctx.value_shape, ctx.value_dtype = scale, value.shape, value.dtype
        return output

    @staticmethod
    def backward(ctx, g_output):
        query, key, *mask = ctx.saved_tensors
        g_value = value_gradient(query, key, mask[0] if mask else None, ctx.scale, g_output.transpose(1, 2),
                                 ctx.value_shape[1])
        return g_value.to(ctx.value_dtype), None, None, None, None, None


def value_gradient(query: torch.Tensor, key: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
                   g_output: torch.Tensor, value_heads: int) -> torch.Tensor:
    """``A^T g_O`` summed over each key-value head's query heads, ``A = softmax(scale Q K^T + M)``
    recomputed in blocks of query rows. ``query`` (B, H, Q, D), ``key`` (B, H_kv, K, D),
    ``g_output`` (B, H, Q, D_v); ``mask`` broadcastable to (B, H, Q, K): boolean (True where a
    query may attend) or additive. Computed in at least float32."""
    dtype = torch.promote_types(query.dtype, torch.float32)
    batch, heads, queries, _ = query.shape
    groups = heads // value_heads
    keys = key.to(dtype)
    if groups > 1:
        keys = keys[:, :, None].expand(batch, value_heads, groups, *key.shape[2:]).reshape(batch, heads, *key.shape[2:])
    g_value = torch.zeros(batch, heads, key.shape[2], g_output.shape[-1], dtype=dtype, device=query.device)
    step = max(1, min(queries, chunk_budget(_BLOCK_ELEMENTS, query.device) // max(1, batch * heads * key.shape[2])))
    # Keys no query of a block may see (beyond the causal diagonal) get A = 0 exactly: they are
    # left out, which halves a causal model's work as a fused kernel's blocks do.
    for start, seen in zip(range(0, queries, step), _keys_seen_by_block(mask, queries, key.shape[2], step)):
        rows = slice(start, start + step)
        block = None if mask is None else (mask[..., rows, :seen] if mask.shape[-2] > 1 else mask[..., :seen])
        scores = torch.matmul(query[:, :, rows].to(dtype), keys[:, :, :seen].transpose(-1, -2)).mul_(scale)
        if block is not None:
            if block.dtype == torch.bool:
                scores.masked_fill_(~block, torch.finfo(dtype).min)
            else:
                scores.add_(block.to(dtype))
        probs = torch.softmax(scores, dim=-1, out=scores)
        g_value[:, :, :seen].add_(torch.matmul(probs.transpose(-1, -2), g_output[:, :, rows].to(dtype)))
    if groups > 1:
        g_value = g_value.view(batch, value_heads, groups, *g_value.shape[2:]).sum(2)
    return g_value


def _keys_seen_by_block(mask: Optional[torch.Tensor], queries: int, keys: int, step: int) -> List[int]:
    """For each block of ``step`` query rows, how many leading keys some query of the block may
    attend to: all of them for no mask, an additive one, or a block with a fully masked row (whose
    map is uniform over every key, as the explicit kernel makes it). Each block is reduced on the
    device to one number and all are read at once (one device synchronisation, not one per block;
    no (Q, K) temporary beyond a block's)."""
    blocks = -(-queries // step)
    if mask is None or mask.dtype != torch.bool or blocks == 0:
        return [keys] * blocks
    rows = mask.reshape(-1, *mask.shape[-2:])  # (examples x heads, Q or 1, K)
    width = mask.shape[-1]
    found = []
    for start in ([0] if rows.shape[-2] == 1 else range(0, queries, step)):
        block = rows[:, start:start + step]
        allowed = block.any(dim=1).any(dim=0)  # (K,): some query of the block may attend
        last = width - allowed.flip(0).to(torch.uint8).argmax()  # the last allowed key + 1
        every_row_open = block.any(dim=-1).all()
        found.append(torch.where(every_row_open, last, torch.full_like(last, keys)))
    seen = torch.stack(found).tolist()
    return seen * blocks if rows.shape[-2] == 1 else seen


def attention_over_constant_map(run: Callable[[torch.Tensor], torch.Tensor], query: torch.Tensor, key: torch.Tensor,
                                value: torch.Tensor, mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """``run(value)`` (a fused attention call returning (B, Q, H, D_v), the map ``softmax(scale
    Q K^T + mask)`` held constant) whose backward pass gives ``value`` the gradient ``A^T g_O``
    and nothing to ``query`` and ``key`` (which must not require grad).

    Example::

        >>> out = attention_over_constant_map(lambda v: sdpa(q, k, v, is_causal=True).transpose(1, 2),
        ...                                   q, k, v, causal_mask, q.shape[-1] ** -0.5)
    """
    if query.requires_grad or key.requires_grad:
        raise ValueError("attention_over_constant_map holds the map constant: query and key must not require grad.")
    if not (torch.is_grad_enabled() and value.requires_grad):
        return run(value)
    return _ConstantMapAttention.apply(value, run, query, key, mask, scale)
