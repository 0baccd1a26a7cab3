"""What the HF kernel's scores function needs to run a few query rows at a time, and its causal mask.

A streamed kernel (:func:`~captum_transformers.propagation.attention.core.softmax_attention` with
``keep_map=False``) returns no map and recomputes it in the backward pass, so its forward pass needs
only ``O = softmax(S) V``. Where ``S = scale Q K^T`` under the upper-left causal mask (or none), that is
what ``torch.nn.functional.scaled_dot_product_attention(..., is_causal=True)`` computes, fused: no
(B, H, Q, K) tensor, the causal half skipped, the model's own "sdpa" forward. :func:`fused_output`
gives the scores function that forward.

Whether a mask is that causal one is read once per mask while it lives unchanged
(:func:`is_causal_mask`; a model's layers share one mask per forward pass), or known without reading
for the masks :func:`causal_mask` makes. A chunk of query rows ``[s, e)`` of a causal mask then
attends to the keys before ``e`` (:func:`keys_needed_of`), with no pass over the chunk's mask.

Example::

    >>> mask = causal_mask(4, 4, torch.device("cpu"))      # (1, 1, 4, 4) lower triangle, remembered
    >>> is_causal_mask(mask), keys_needed_of(mask)(mask[..., 1:3, :])
    (True, 3)
"""
from __future__ import annotations

import weakref
from typing import Callable, Dict, Optional, Tuple

import torch

from ...propagation.attention.chunk_products import add_product

# The masks causal_mask made that are alive now, by id (dropped with their last reference), and
# their versions then (a mask written to since is read again).
_MADE: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
_MADE_VERSION: Dict[int, int] = {}
_LATEST: Dict[Tuple[int, int, torch.device], "weakref.ref[torch.Tensor]"] = {}
# Masks is_causal_mask read, by (id of the tensor viewed, offset, shape, strides): (a weak reference
# to that tensor, its version then, the answer).
_READ: Dict[tuple, Tuple["weakref.ref[torch.Tensor]", int, bool]] = {}


def causal_mask(num_queries: int, num_keys: int, device: torch.device) -> torch.Tensor:
    """The boolean (1, 1, Q, K) mask ``k <= q`` (upper-left aligned, as SDPA's ``is_causal``): the one
    made last for this shape and device while it is alive (the kernel only reads it), so the layers of
    a forward pass share one (16 MiB at 4k tokens, where each layer made its own)."""
    key = (num_queries, num_keys, torch.device(device))
    alive = _LATEST.get(key)
    mask = alive() if alive is not None else None
    if mask is None or _MADE_VERSION.get(id(mask)) != mask._version:  # none alive, or one written to
        mask = torch.ones(1, 1, num_queries, num_keys, dtype=torch.bool, device=device).tril_()
        for dead in [made for made in _MADE_VERSION if made not in _MADE]:
            del _MADE_VERSION[dead]
        _MADE[id(mask)] = mask
        _MADE_VERSION[id(mask)] = mask._version
        for other in [made for made in _LATEST if made[:2] != key[:2]]:  # one shape at a time, per device
            del _LATEST[other]  # (a model spread over devices shares one per device)
        _LATEST[key] = weakref.ref(mask)
    return mask


def _made_here(mask: torch.Tensor) -> bool:
    """Whether ``mask`` is a :func:`causal_mask`, or a view of all of it."""
    base = mask if mask._base is None else mask._base
    if _MADE.get(id(base)) is not base or _MADE_VERSION.get(id(base)) != base._version:
        return False
    return base is mask or (mask.shape == base.shape and mask.stride() == base.stride()
                            and mask.storage_offset() == base.storage_offset())


def is_causal_mask(mask: Optional[torch.Tensor]) -> bool:
    """Whether ``mask`` (B, 1, Q, K), boolean (True: open) or additive, is the upper-left causal
    mask for every example: open (True, or exactly 0) where ``k <= q``, blocked elsewhere (False,
    or at most half the dtype's lowest value: its ``exp`` after the row's maximum is exactly 0)."""
    if mask is None or mask.dim() != 4 or mask.shape[1] != 1:
        return False
    if _made_here(mask):
        return True
    # Each layer cuts its own view of the model's mask: known by the tensor it views and where.
    root = mask if mask._base is None else mask._base
    place = (id(root), mask.storage_offset(), tuple(mask.shape), mask.stride())
    known = _READ.get(place)
    if known is not None and known[0]() is root and known[1] == root._version:
        return known[2]
    verdict = _reads_causal(mask)
    for stale in [key for key, (ref, _, _) in list(_READ.items()) if ref() is None]:
        del _READ[stale]
    _READ[place] = (weakref.ref(root), root._version, verdict)
    return verdict


def _reads_causal(mask: torch.Tensor, block: int = 256) -> bool:
    """:func:`is_causal_mask` from the values, a block of query rows ``[s, e)`` at a time: the keys
    before ``s`` open and those from ``e`` on blocked in every row (reductions, no temporaries of
    the mask's size: one read of it), the diagonal block compared entry by entry."""
    num_queries, num_keys = mask.shape[-2:]
    lowest = None if mask.dtype == torch.bool else torch.finfo(mask.dtype).min / 2
    for start in range(0, num_queries, block):
        rows = mask[..., start:start + block, :]
        stop = start + rows.shape[-2]
        before, diagonal, after = rows[..., :start], rows[..., start:stop], rows[..., stop:]
        earlier = torch.arange(start, start + diagonal.shape[-1], device=mask.device) \
            <= torch.arange(start, stop, device=mask.device)[:, None]
        if lowest is None:
            causal = bool(before.all()) and not bool(after.any()) and torch.equal(diagonal, earlier.expand_as(diagonal))
        else:
            causal = not bool(before.any()) and (after.numel() == 0 or bool(after.amax() <= lowest)) \
                and torch.equal(diagonal == 0, earlier.expand_as(diagonal)) \
                and bool((diagonal <= lowest).logical_or_(earlier).all())
        if not causal:
            return False
    return True


def _first_row(mask: torch.Tensor, rows: torch.Tensor) -> Optional[int]:
    """The first query row of ``rows`` where it is a slice of query rows of ``mask`` (its leading
    keys, every example), else None."""
    if rows.dim() != 4 or rows.shape[:2] != mask.shape[:2] or rows.shape[-1] > mask.shape[-1] \
            or rows.stride() != mask.stride() or mask.stride(-2) <= 0 \
            or rows.untyped_storage().data_ptr() != mask.untyped_storage().data_ptr():
        return None
    first, remainder = divmod(rows.storage_offset() - mask.storage_offset(), mask.stride(-2))
    return first if remainder == 0 and 0 <= first and first + rows.shape[-2] <= mask.shape[-2] else None


def keys_needed_of(mask: torch.Tensor) -> Callable[..., int]:
    """The ``keys_needed`` of a scores function whose mask (its last extra) is ``mask``: rows
    ``[s, e)`` of a causal ``mask`` (:func:`is_causal_mask`) attend to ``min(e, K)`` keys, read from
    the slice's place in ``mask``; any other rows as :func:`keys_needed` reads them."""
    def needed(*extras: torch.Tensor) -> int:
        rows = extras[-1]
        first = _first_row(mask, rows)
        if first is not None and is_causal_mask(mask):
            return min(first + rows.shape[-2], rows.shape[-1])
        return keys_needed(rows)

    return needed


def masked_from(mask: torch.Tensor, rows: torch.Tensor) -> int:
    """The first key that ``rows`` (query rows ``[s, e)`` of ``mask``, its leading keys) may block:
    ``s + 1`` for a causal ``mask`` (every row of the chunk attends to the keys up to ``s``), so
    masking the scores from there on gives the same values with a pass over ``e - s - 1`` columns,
    not ``e``; 0 for any other mask."""
    first = _first_row(mask, rows)
    if not first or not is_causal_mask(mask):  # (from the first row on: nothing to skip, nothing read)
        return 0
    return min(first + 1, rows.shape[-1])


def keys_needed(*extras: torch.Tensor) -> int:
    """How many leading keys some of a chunk of query rows may attend to, from its mask (the
    last extra, (B, 1, c, K), boolean or additive): after the last open key every probability is
    exactly 0 (a causal mask), so the chunk's map stops there. All keys when a row has none open
    (its softmax is then over every key)."""
    mask = extras[-1]
    open_keys = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    open_keys = open_keys.reshape(-1, open_keys.shape[-1])
    if not bool(open_keys.any(dim=-1).all()):
        return mask.shape[-1]
    return int(open_keys.any(dim=0).nonzero().max()) + 1


def fused_output(mask: Optional[torch.Tensor], scaling: float, plain: bool) -> Optional[Callable]:
    r"""``(Q, K, V, *extras) -> O`` by ``scaled_dot_product_attention`` for a scores function
    ``S = scaling Q K^T`` masked by ``mask`` (its last extra, or None), or None where that would
    not give the explicit attention's output (``plain=False``: a position bias or soft-capping in
    the scores).

    .. math:: O = \mathrm{softmax}(\mathrm{scaling}\, Q K^T + M)\, V

    The same values to rounding (a fused kernel sums in another order). The returned function
    gives None (the caller then runs the explicit operations) for any mask but the causal one
    (:func:`is_causal_mask`: a fully blocked row is uniform in the explicit softmax, not in SDPA's),
    off CPU (where SDPA may fall back to a kernel that makes the map), and in half precision (the
    explicit scores are rounded to half, the fused kernel's are not).
    """
    if not plain:
        return None

    def output(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *extras: torch.Tensor):
        if query.device.type != "cpu" or query.dtype not in (torch.float32, torch.float64) \
                or not query.dtype == key.dtype == value.dtype or query.dim() != 4:
            return None
        causal = mask is not None
        if causal and not (query.shape[-2] > 1 and is_causal_mask(mask)):
            return None
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=scaling)

    return output


def plain_gradient_of(scaling: float) -> Callable:
    r"""The ``plain_gradient`` of scores ``S = scaling Q K^T`` plus constant masks: ``(g_S, Q, K) ->
    (g_Q, g_K)`` with ``g_Q = scaling g_S K`` and ``g_K = scaling g_S^T Q`` (``g_S`` is scaled in
    place). ``key_grad``: a tensor that ``g_K`` is added to in its own buffer (returned as ``g_K``),
    the chunked backward pass's sum over chunks of rows (``accumulates``); ``g_S`` is then left as
    it is and the scaling applied to the products (one pass less over a (B, H, c, K) chunk). A
    ``key_grad`` with H / G heads sums each group of G heads, whose keys are the same (attention_core's
    ``kv_groups``): one product per group (:func:`grouped_scores`).

    Example::

        >>> g_query, g_key = plain_gradient_of(0.125)(g_scores, query, key)
    """
    def plain_gradient(g_scores: torch.Tensor, query: torch.Tensor, key_states: torch.Tensor,
                       key_grad: Optional[torch.Tensor] = None):
        if key_grad is None:
            g_scores = g_scores.mul_(scaling)
            return torch.matmul(g_scores, key_states), torch.matmul(g_scores.transpose(-1, -2), query)
        groups = key_states.shape[1] // key_grad.shape[1]
        g_query = torch.matmul(_stacked(g_scores, groups), key_states[:, ::groups]).mul_(scaling)
        key_grad = add_product(key_grad, _stacked(g_scores, groups).transpose(-1, -2), _stacked(query, groups),
                               alpha=scaling)
        return g_query.view(g_scores.shape[:-1] + g_query.shape[-1:]), key_grad

    plain_gradient.accumulates = True
    return plain_gradient


def _stacked(tensor: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, H, c, n) as (B, H / G, G c, n): the rows of each group's G heads stacked."""
    if groups == 1:
        return tensor
    return tensor.reshape(tensor.shape[0], tensor.shape[1] // groups, groups * tensor.shape[2], tensor.shape[3])


def grouped_scores(query: torch.Tensor, key_states: torch.Tensor, groups: int, out: torch.Tensor) -> torch.Tensor:
    """``Q K^T`` into ``out`` (B, H, c, K), for keys whose heads repeat each of H / G heads G times
    (``chunk_products.repeat_heads``): one product per group, its G heads' query rows stacked, each key read once."""
    if groups == 1 or query.dim() != 4 or query.shape[:2] != key_states.shape[:2] or query.shape[1] % groups:
        return torch.matmul(query, key_states.transpose(-1, -2), out=out)
    torch.matmul(_stacked(query, groups), key_states[:, ::groups].transpose(-1, -2), out=_stacked(out, groups))
    return out
