"""Attention maps a few query rows at a time: the chunk size and the operands of each chunk.

The softmax of attention is row-wise, so a chunk of query rows ``[s, e)`` of the map
``softmax(S(Q, K))`` is the softmax of that chunk's scores, made from the query rows alone
(and the rows of any mask broadcast against the map). These functions size the chunks
(:func:`rows_per_chunk`: about ``ROW_CHUNK_BYTES`` of (B, H, c, K) map per chunk on a CPU,
:func:`chunk_budget` times larger on an accelerator), cut the operands to a chunk
(:func:`rows_of`, :func:`row_chunks`) and take the chunk's softmax in its scores' buffer
(:func:`softmax_in_place`). Pure tensor functions: the replayed maps of
:mod:`.replayed_rows` and the chunked attention backward pass of
:mod:`~captum_transformers.propagation.attention.core` share them.

Example::

    >>> for rows, q_rows, keys, values, extras_rows, stop in row_chunks(scores_fn, q, k, v, extras):
    ...     probs = softmax_in_place(scores_fn(q_rows, keys, *extras_rows), None)   # (B, H, c, stop)
"""
from __future__ import annotations

from typing import Optional

import torch

# On an accelerator, chunks this many times larger than on a CPU. A chunk's kernels there take
# microseconds, so CPU-sized chunks leave it waiting on Python's kernel launches (one H100, a 1B
# Llama at 4k tokens: GenericAttention 22.4 s with CPU-sized chunks, 1.37 s with 16 times larger).
ACCELERATOR_CHUNK_SCALE = 32

# Each chunk of query rows recomputes a (B, H, c, K) map of about this size (and its gradient,
# scores and softmax Jacobian next to it): what a streamed backward pass adds to the model's own.
# On a CPU (an accelerator's are larger: chunk_budget).
ROW_CHUNK_BYTES = 4 * 2**20


def chunk_budget(cpu_budget: int, device: torch.device) -> int:
    """The size of a chunk (in bytes or elements, as ``cpu_budget``) for tensors on ``device``."""
    return cpu_budget if device.type == "cpu" else cpu_budget * ACCELERATOR_CHUNK_SCALE


def rows_per_chunk(query: torch.Tensor, key: torch.Tensor) -> int:
    """How many query rows of the (B, H, Q, K) map of ``query`` (B, H, Q, d) against ``key``
    (B, H, K, d) make one chunk: about ``ROW_CHUNK_BYTES`` (float32 or wider), at least one row."""
    per_row = query.shape[0] * query.shape[1] * key.shape[-2] * max(query.element_size(), 4)
    return max(1, chunk_budget(ROW_CHUNK_BYTES, query.device) // per_row)


def rows_of(tensor: torch.Tensor, rows: slice, num_queries: int) -> torch.Tensor:
    """An operand broadcast against (B, H, Q, K) cut to the query rows ``rows`` (dimension -2,
    where it has the queries; a size-1 or missing query axis is broadcast as it is)."""
    if tensor.dim() >= 2 and tensor.shape[-2] == num_queries and num_queries > 1:
        return tensor[..., rows, :]
    return tensor


def row_chunks(scores_fn, query, key, value, extras, cut: bool = True):
    """``(rows, Q_c, K_c, V_c, extras_c, keys)`` for each chunk of query rows: the operands cut
    to the rows and, where ``scores_fn.keys_needed(rows, *extras_c)`` says that every key from
    ``keys`` on is masked in all of these rows (a causal mask), to the keys before it: the
    masked keys' probabilities are exactly 0, so the map's other entries keep their values.
    ``cut=False`` keeps every key: the gradient at a masked entry is not 0 (``g_O V^T``), and a
    reduction that reads it there (Grad-CAM's head weights) needs it."""
    num_queries, num_keys = query.shape[-2], key.shape[-2]
    chunk = rows_per_chunk(query, key)
    keys_needed = getattr(scores_fn, "keys_needed", None) if cut else None
    for start in range(0, num_queries, chunk):
        rows = slice(start, min(start + chunk, num_queries))
        extras_rows = [rows_of(e, rows, num_queries) for e in extras]
        keys = num_keys if keys_needed is None else keys_needed(*extras_rows)
        if keys < num_keys:
            extras_rows = [e[..., :keys] if e.dim() and e.shape[-1] == num_keys else e for e in extras_rows]
        yield (rows, query[..., rows, :], key[..., :keys, :], value[..., :keys, :], extras_rows, keys)


def softmax_in_place(scores: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """``softmax(scores, dim=-1)`` in ``dtype`` (None: the scores' own), written into ``scores``
    where the dtypes agree (no second (B, H, c, K) tensor), else into a new tensor."""
    if scores.dtype == (dtype or scores.dtype):
        return torch.softmax(scores, dim=-1, out=scores)
    return torch.softmax(scores, dim=-1, dtype=dtype)
