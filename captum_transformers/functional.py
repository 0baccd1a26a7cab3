"""Pure tensor math shared by the attention methods. No modules, no hooks, no state.

Shapes: ``probs`` and ``grad`` are attention probabilities and their gradients,
``(B, H, Q, K)``; fused maps are ``(B, Q, K)``; relevance rows are ``(B, N)``.
Reductions accumulate in at least float32 so half-precision models stay accurate.
The methods carry their rows with :mod:`~captum_transformers.capture.row_chains` (any layout);
the dense row products below (:func:`rollout_rows`, :func:`rollout_rows_of_attention`,
:func:`self_attention_relevance_rows`) are the plain-matrix statements tests compare with.
"""
from __future__ import annotations

from typing import Literal, Optional, Sequence, Union

import torch

HeadFusion = Literal["mean", "max", "min"]
HEAD_FUSIONS = ("mean", "max", "min")


def _accumulation_dtype(tensor: torch.Tensor) -> torch.dtype:
    return torch.promote_types(tensor.dtype, torch.float32)


def fuse_heads(probs: torch.Tensor, how: HeadFusion = "mean") -> torch.Tensor:
    """Combine the heads of ``probs`` (B, H, Q, K) into one map (B, Q, K)."""
    probs = probs.to(_accumulation_dtype(probs))
    if how == "mean":
        return probs.mean(dim=1)
    if how == "max":
        return probs.amax(dim=1)
    if how == "min":
        return probs.amin(dim=1)
    raise ValueError(f"head_fusion must be one of {HEAD_FUSIONS}, got {how!r}.")


def gradient_weighted_heads(probs: torch.Tensor, grad: torch.Tensor, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Chefer et al. (ICCV 2021) Eq. 5: ``Abar = E_h[(grad(A) * A)^+]``.

    ``valid`` is accepted for a uniform signature; padded keys already have ``A = 0``.
    On a CPU without a graph to record, the heads are summed one at a time through one (B, Q, K)
    buffer: no (B, H, Q, K) product is made (on a long sequence's chunks of rows, fresh memory
    costs a page fault per 4 KiB, and a head's product stays in cache for its sum); an accelerator
    gets one product (a kernel launch per head would cost more than the head's arithmetic).
    Example: one head, ``A = [[.5, .5]]``, ``grad = [[2., -4.]]`` gives ``[[1., 0.]]``.
    """
    dtype = _accumulation_dtype(probs)
    if not _heads_one_at_a_time(probs, grad):
        return (grad.to(dtype) * probs.to(dtype)).clamp_(min=0).mean(dim=1)  # the product is fresh: clamped in place
    heads, total, part = probs.shape[1], None, None
    for head in range(heads):
        part = torch.mul(grad[:, head].to(dtype), probs[:, head].to(dtype), out=part).clamp_(min=0)
        total = part.clone() if total is None else total.add_(part)
    return total.div_(heads)


def _heads_one_at_a_time(probs: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether :func:`gradient_weighted_heads` sums head by head: on a CPU, with no graph to record."""
    recording = torch.is_grad_enabled() and (probs.requires_grad or grad.requires_grad)
    return not recording and probs.shape[1] > 0 and probs.device.type == "cpu"


gradient_weighted_heads.reads_valid = False  # the recorder need not make the pairs (a pass per chunk of rows)
gradient_weighted_heads.row_separable = True  # each query row's value reads that row alone: streamable


def head_fusion_of(how: HeadFusion):
    """:func:`fuse_heads` with ``how`` as a forward reduction, marked with it (``.head_fusion``): what
    a replay (:mod:`~.replayed_rows`) may recompute in its place; an unmarked reduction is kept."""
    def fused(probs: torch.Tensor) -> torch.Tensor:
        return fuse_heads(probs, how)

    fused.head_fusion = how
    return fused


def gradcam_heads(probs: torch.Tensor, grad: torch.Tensor, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Grad-CAM on attention heads as Chefer et al.'s BERT code computes it (their ERASER baseline).

    Each head is weighted by its gradient averaged over all (query, key) pairs; the
    weighted heads are averaged and negative values removed:
    ``cam = (E_h[mean_qk(grad(A)) * A])^+``. With ``valid`` (B, 1, Q, K) the mean runs over
    real (query, key) pairs only, so padding does not change an example's map.
    """
    dtype = _accumulation_dtype(probs)
    grad = grad.to(dtype)
    if valid is None:
        weights = grad.mean(dim=(-2, -1), keepdim=True)
    else:
        valid = valid.to(dtype)
        weights = (grad * valid).sum(dim=(-2, -1), keepdim=True) / valid.sum(dim=(-2, -1), keepdim=True).clamp(min=1)
    return (weights * probs.to(dtype)).mean(dim=1).clamp(min=0)


def gradcam_heads_by_row(probs: torch.Tensor, grad: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Grad-CAM on attention heads as the CVPR'21 ViT baseline computes it: each head is
    weighted, per query row, by its gradient averaged over that row's ``columns``
    (the patch columns of the explained row in the authors' code), ``cam_q =
    (E_h[w_{h,q} A_{h,q,:}])^+`` with ``w_{h,q} = mean_{k in columns} grad(A)_{h,q,k}``.

    ``probs``, ``grad``: (B, H, Q, K); ``columns``: (B, K) or per row (B, Q, K) booleans, True
    where a key column counts (a patch token that is not padding). Example: with one head, ``A = [[.5, .5]]``,
    ``grad = [[2., 4.]]`` and both columns counted, ``w = 3`` and the row is ``[1.5, 1.5]``.
    """
    dtype = _accumulation_dtype(probs)
    counted = columns.to(dtype)[:, None, None, :] if columns.dim() == 2 else columns.to(dtype)[:, None]
    weights = (grad.to(dtype) * counted).sum(dim=-1, keepdim=True) / counted.sum(dim=-1, keepdim=True).clamp(min=1)
    return (weights * probs.to(dtype)).mean(dim=1).clamp(min=0)


def discard_lowest(maps: torch.Tensor, ratio: Union[float, Sequence[float], torch.Tensor],
                   valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Zero the lowest ``ratio`` fraction of each example's off-diagonal attention.

    ``ratio`` is a float or one value per example. Diagonal entries are never discarded
    (they carry the residual stream once the identity is added). ``valid`` (B, Q, K), when
    given, marks the real (query, key) pairs: only those count and compete, so padding does
    not change an example's map. Ties are broken by position, so exactly
    ``floor(ratio * n)`` entries are zeroed per example, ``n`` its candidate count.
    """
    batch, queries, keys = maps.shape
    ratio_t = torch.as_tensor(ratio, dtype=torch.float64, device=maps.device).reshape(-1)
    if ratio_t.numel() == 1:
        ratio_t = ratio_t.expand(batch)
    if ratio_t.numel() != batch:
        raise ValueError(f"discard_ratio needs one value or {batch} values (one per example), got {ratio_t.numel()}.")
    if bool(((ratio_t < 0) | (ratio_t >= 1)).any()):
        raise ValueError(f"discard_ratio values must lie in [0, 1), got {ratio_t.tolist()}.")
    if bool((ratio_t == 0).all()):
        return maps
    flat = maps.reshape(batch, -1)
    diagonal = torch.zeros(queries, keys, dtype=torch.bool, device=maps.device)
    if queries == keys:
        diagonal.fill_diagonal_(True)
    excluded = diagonal.reshape(1, -1).expand(batch, -1)
    if valid is not None:
        excluded = excluded | ~valid.reshape(batch, -1).to(torch.bool)
    candidates = (~excluded).sum(dim=1).to(torch.float64)
    count = torch.floor(ratio_t * candidates).to(torch.long)
    # Rank every entry per example; excluded entries are pushed past all candidates.
    scores = flat.masked_fill(excluded, float("inf"))
    order = scores.argsort(dim=-1, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(flat.shape[1], device=maps.device).expand_as(order))
    drop = ranks < count.unsqueeze(1)
    return flat.masked_fill(drop, 0).reshape(batch, queries, keys)


def add_identity_and_normalize(maps: torch.Tensor) -> torch.Tensor:
    """Abnar & Zuidema's residual correction: ``(I + A)`` with rows rescaled to sum to 1."""
    eye = torch.eye(maps.shape[-1], dtype=maps.dtype, device=maps.device)
    augmented = maps + eye
    return augmented / augmented.sum(dim=-1, keepdim=True)


def query_vectors(query_rows: torch.Tensor, num_tokens: int, dtype: torch.dtype = torch.float32,
                  weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One row vector per example mixing the one-hot rows in ``query_rows`` (B, R).

    The rows are averaged, or weighted by ``weights`` (B, R) when given.
    """
    batch = query_rows.shape[0]
    vectors = torch.zeros(batch, num_tokens, dtype=dtype, device=query_rows.device)
    if weights is None:
        weights = torch.full(query_rows.shape, 1.0 / query_rows.shape[1], dtype=dtype, device=query_rows.device)
    return vectors.scatter_add_(1, query_rows, weights.to(dtype))


def rollout_rows(maps: Sequence[torch.Tensor], start: torch.Tensor) -> torch.Tensor:
    """Rows of the attention rollout ``Ahat_L ... Ahat_1`` selected by ``start`` (B, N).

    ``maps`` are the per-layer residual-corrected maps in forward order. Multiplying the
    row vector from the left costs O(L B N^2) instead of the O(L B N^3) matrix chain.
    """
    row = start.to(maps[-1].dtype)
    for layer_map in reversed(list(maps)):
        row = torch.bmm(row.unsqueeze(1), layer_map).squeeze(1)
    return row


def rollout_rows_of_attention(maps: Sequence[torch.Tensor], start: torch.Tensor) -> torch.Tensor:
    r""":func:`rollout_rows` of the residual-corrected maps, from the head-fused maps ``A``
    themselves: with ``s = rowsum(A) + 1``, a row ``r`` times ``(I + A) / s`` is

    .. math:: r \hat A = (r / s) A + r / s,

    so neither ``I + A`` nor its normalised copy (two (B, N, N) tensors per layer) is made.
    """
    row = start.to(maps[-1].dtype)
    for layer_map in reversed(list(maps)):
        scaled = row / (layer_map.sum(dim=-1) + 1)
        row = torch.bmm(scaled.unsqueeze(1), layer_map).squeeze(1).add_(scaled)
    return row


def self_attention_relevance_rows(maps: Sequence[torch.Tensor], start: torch.Tensor) -> torch.Tensor:
    """Rows of ICCV'21 Eq. 6 applied over all layers: ``R = (I + Abar_L) ... (I + Abar_1)``.

    Eq. 6 updates ``R <- R + Abar R`` from ``R = I``; the selected rows of the result are
    computed right to left as ``r <- r + r Abar_l`` for l = L..1.
    """
    row = start.to(maps[-1].dtype)
    for layer_map in reversed(list(maps)):
        row = row + torch.bmm(row.unsqueeze(1), layer_map).squeeze(1)
    return row
