"""Softmax attention ``O = softmax(S(Q, K)) V`` as one autograd Function that keeps no map.

A captured or rule-carrying attention written as separate operations keeps, per layer, the
probabilities ``A`` (for ``A V``'s gradient) and, under the softmax identity rule, the
scores: (B, H, Q, K) tensors, where a training step's fused attention keeps only Q, K, V and
O. Here the backward recomputes ``S`` and ``A`` from Q and K (one product and one softmax
per layer), and hands ``A`` and the gradient at it to an observer (the recorder), so nothing
of size (B, H, Q, K) outlives its layer's backward.

Where the observer streams the map into explained rows (``takes_rows``,
:mod:`~captum_transformers.capture.row_stream`) and the scores function is marked
``row_sliceable``, forward and backward run a few query rows at a time
(:func:`~captum_transformers.capture.row_chunks.row_chunks`, stopping each chunk at its last open
key under a causal mask): no (B, H, Q, K) tensor is made at all, only (B, H, c, K) chunks of about
``capture.row_chunks.ROW_CHUNK_BYTES``.

Two backward passes through one graph (TransformerRelevance: the relevance, then the plain
gradient, see :mod:`backward_switch`) need the relevance pass's gradient at ``A`` when the
plain one arrives. Keeping it would cost a (B, H, Q, K) tensor per layer; instead the
Function keeps the gradient at its output, ``g_O`` (B, H, Q, d), and recomputes
``g_A = g_O V^T`` (halved under the uniform rule) in the second pass.
"""
from __future__ import annotations

from typing import Callable, Optional, Protocol, Tuple

import torch

from ..backward_switch import SWITCH
from ...capture.row_chunks import row_chunks, rows_of
from .chunk_products import (ChunkBuffers, add_product, group_gradient, group_zeros, grouped, halves_map_gradient,
                             kv_groups, map_gradient, model_heads, repeat_heads)
from .head_products import heads_matmul
from ..rules.operations import ACTIVE_RULES
from ..rules.own_output import own_output
from .recomputed_softmax import owns_buffer, recompute_under_rules, scores_gradient
from .sinks import attention_softmax
from . import row_chunked_rules


class MapObserver(Protocol):
    """Receives the gradient at the attention map when the backward pass reaches it."""

    wanted: bool      # whether this pass reduces the map at all
    deferred: bool    # whether a later pass through the same graph reduces both gradients together

    def __call__(self, probs: torch.Tensor, grad: torch.Tensor) -> None: ...

    def defer(self) -> None: ...

    def first(self, probs: torch.Tensor, grad: torch.Tensor) -> None: ...

    def second(self, probs: torch.Tensor, grad: torch.Tensor) -> None: ...


def _attend(scores_fn, query, key, value, extras, softmax_dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """The two operations, ``(A V, A)``, exactly as the explicit attention computes them.

    Without gradients the softmax overwrites the scores (same values: it reads each row before
    writing it): one (B, H, Q, K) buffer per layer instead of two, and no fresh pages to fault in.
    Where the scores function allows it, the batch runs in chunks (see :func:`_examples_per_chunk`).
    """
    chunk = _examples_per_chunk(scores_fn, query, key, value, extras)
    if chunk:
        return _attend_in_chunks(scores_fn, query, key, value, extras, softmax_dtype, chunk)
    scores = scores_fn(query, key, *extras)
    in_place = not torch.is_grad_enabled() and scores._base is None and all(scores is not t for t in (query, key,
                                                                                                    *extras))
    probs = attention_softmax(scores_fn, scores, softmax_dtype, in_place).to(query.dtype)
    return heads_matmul(probs, value, tokens_major=True), probs


# A chunk's scores of about this size (a core's L2 cache) stay cached from their product through
# the softmax to the product with V. On a 16-image ViT batch (197 tokens, 4 heads: one example,
# 0.6 MiB, per chunk) AttentionRollout costs 2-4 % less of a forward pass than with the whole batch
# at once; chunks of 2 or 4 examples gained less.
_CHUNK_BYTES = 2**20


def _examples_per_chunk(scores_fn, query, key, value, extras) -> int:
    """How many examples each chunk of a gradient-free CPU attention holds, or 0 for one pass.

    Only a scores function marked ``batch_sliceable`` (its scores for a slice of the batch
    are that slice of its scores: no per-example tensor captured from outside) is chunked, and
    only when every extra operand either has four dimensions, the first of size B (sliced) or 1,
    or has fewer (broadcast over the batch: the scores are (B, H, Q, K))."""
    if torch.is_grad_enabled() or query.device.type != "cpu" or not getattr(scores_fn, "batch_sliceable", False) \
            or query.dim() != 4:
        return 0
    batch = query.shape[0]
    if key.shape[0] != batch or value.shape[0] != batch \
            or any(e.dim() > 4 or (e.dim() == 4 and e.shape[0] not in (1, batch)) for e in extras):
        return 0
    per_example = query.shape[1] * query.shape[2] * key.shape[2] * query.element_size()
    chunk = max(1, int(_CHUNK_BYTES // per_example))
    return chunk if chunk < batch else 0


def _attend_in_chunks(scores_fn, query, key, value, extras, softmax_dtype, chunk: int):
    """:func:`_attend` a few examples at a time into one map and one output buffer: equal
    values (every operation acts on each example's rows alone)."""
    batch = query.shape[0]
    probs = output = None
    for start in range(0, batch, chunk):
        part = slice(start, start + chunk)
        scores = scores_fn(query[part], key[part], *(e[part] if e.dim() == 4 and e.shape[0] == batch else e
                                                       for e in extras))
        if probs is None:
            probs = scores.new_empty((batch, *scores.shape[1:]), dtype=query.dtype)
            rows, heads = scores.shape[2], scores.shape[1]
            output = value.new_empty(batch, rows, heads, value.shape[-1]).transpose(1, 2)
        if getattr(scores_fn, "sinks", None) is not None:
            probs[part].copy_(attention_softmax(scores_fn, scores, softmax_dtype))
        elif scores.dtype == probs.dtype and softmax_dtype in (None, scores.dtype):
            torch.softmax(scores, dim=-1, out=probs[part])
        else:
            probs[part].copy_(torch.softmax(scores, dim=-1, dtype=softmax_dtype))
        heads_matmul(probs[part], value[part], tokens_major=True, out=output[part])
    return output, probs


class _SoftmaxAttention(torch.autograd.Function):
    """Forward: exactly the operations of the explicit attention (bit-identical outputs).
    Backward: recompute ``S`` under the rules of the forward (or plainly), ``A`` from it, and
    differentiate ``A V`` (the uniform rule halves both gradients), then the softmax (its
    identity rule or its Jacobian), then ``S`` by autograd."""

    @staticmethod
    def forward(ctx, scores_fn, softmax_dtype, mode, switch, observer, keep_map, kv_groups, query, key, value,
                *extras):
        key_states, value_states = repeat_heads(key, kv_groups), repeat_heads(value, kv_groups)
        if keep_map:
            output, probs = _attend(scores_fn, query, key_states, value_states, extras, softmax_dtype)
        else:  # the map is not returned: made a few rows at a time
            output, probs = _attend_rows(scores_fn, query, key_states, value_states, extras, softmax_dtype)
        del key_states, value_states
        ctx.scores_fn, ctx.softmax_dtype, ctx.mode, ctx.switch, ctx.observer = (scores_fn, softmax_dtype, mode,
                                                                                switch, observer)
        ctx.kv_groups = kv_groups
        ctx.first_pass = None
        # The product's uniform rule applies only where both operands carry relevance.
        ctx.both_operands = value.requires_grad and any(t.requires_grad for t in (query, key, *extras))
        ctx.save_for_backward(query, key, value, *extras)
        ctx.set_materialize_grads(False)
        # Tensors of their own, not views of the (B, Q, H, d) buffer: a model may update them in place.
        operands = (query, key, value, *extras)
        return own_output(output, operands), own_output(probs, operands)

    @staticmethod
    def backward(ctx, g_output, g_probs_outside):
        query, key, value, *extras = ctx.saved_tensors
        groups = ctx.kv_groups
        with torch.no_grad():  # this layer's repeated heads, for this backward pass only
            repeated = [repeat_heads(t, groups).requires_grad_(t.requires_grad) if groups > 1 else t
                        for t in (key, value)]
        grads = _SoftmaxAttention._backward(ctx, g_output, g_probs_outside, query, *repeated, extras)
        del repeated
        # Summed per group where a chunked path has not summed them (the first six inputs are not tensors).
        g_key, g_value = (g if g is None or g.shape[1] == key.shape[1] else model_heads(g, groups) for g in grads[7:9])
        return (*grads[:6], None, grads[6], g_key, g_value, *grads[9:])

    @staticmethod
    def _backward(ctx, g_output, g_probs_outside, query, key, value, extras):
        plain = ctx.mode is None or (ctx.switch is not None and ctx.switch.plain)
        rules = None if ctx.mode is None else ctx.mode.rules
        plain_gradient = _plain_gradient_of_scores(ctx, plain, extras)
        chunked = _takes_rows(ctx)
        if chunked == "defer" and not any(t.requires_grad for t in extras):
            return row_chunked_rules.rules_backward_in_row_chunks(ctx, g_output, g_probs_outside, query, key, value,
                                                                  extras)
        if plain_gradient is not None and chunked in ("now", "pair", "unread"):
            return _plain_backward_in_row_chunks(ctx, plain_gradient, g_output, g_probs_outside, query, key, value,
                                                 extras)
        if plain_gradient is not None:
            # The scores and the map again, without a graph, the softmax in the scores' buffer.
            with torch.no_grad():
                scores = ctx.scores_fn(query, key, *extras)
            soft = attention_softmax(ctx.scores_fn, scores, ctx.softmax_dtype, in_place=True)
            leaves = ()
        else:
            leaves = [t.detach().requires_grad_(t.requires_grad) for t in (query, key, *extras)]
            scores = recompute_under_rules(ctx.scores_fn, leaves, None if plain else ctx.mode, ctx.switch)
            soft = attention_softmax(ctx.scores_fn, scores.detach(), ctx.softmax_dtype)
        probs = soft.to(query.dtype)
        if g_output is None:
            g_output = torch.zeros((*probs.shape[:-1], value.shape[-1]), dtype=value.dtype, device=value.device)
        report = _observer_for_this_pass(ctx)
        if report == "pair":  # the first pass's gradient at A, reduced before this pass's is made
            first_output, first_outside = ctx.first_pass
            ctx.first_pass = None
            first = map_gradient(value, first_output, first_outside, halved=halves_map_gradient(ctx))
            ctx.observer.first(probs, first)
            del first, first_output, first_outside
        halved = not plain and halves_map_gradient(ctx)
        g_probs = map_gradient(value, g_output, g_probs_outside, halved)
        g_value = torch.matmul(probs.transpose(-1, -2), g_output)
        if halved:
            g_value.mul_(0.5)
        if report == "defer":  # keep g_O (B, H, Q, d), not the gradient at A (B, H, Q, K)
            ctx.first_pass = (g_output, g_probs_outside)
            ctx.observer.defer()
        elif report == "pair":
            ctx.observer.second(probs, g_probs)
        elif report == "now":
            ctx.observer(probs, g_probs)
        g_scores = scores_gradient(soft, scores.detach(), g_probs.to(soft.dtype), -1,
                                   identity=not plain and rules.softmax == "identity",
                                   owned=plain_gradient is None and owns_buffer(scores))
        del soft, probs, g_probs
        if plain_gradient is not None:
            g_query, g_key = plain_gradient(g_scores.to(query.dtype), query, key)
            g_value = g_value.sum_to_size(value.shape) if value.requires_grad else None
            return (None, None, None, None, None, None, g_query if query.requires_grad else None,
                    g_key if key.requires_grad else None, g_value, *[None for _ in extras])
        wanted = [leaf for leaf in leaves if leaf.requires_grad]
        grads = iter(torch.autograd.grad(scores, wanted, g_scores.to(scores.dtype), allow_unused=True)
                     if wanted else ())
        g_query, g_key, *g_extras = [next(grads) if leaf.requires_grad else None for leaf in leaves]
        g_value = g_value.sum_to_size(value.shape) if value.requires_grad else None
        return (None, None, None, None, None, None, g_query, g_key, g_value, *g_extras)


def _attend_rows(scores_fn, query, key, value, extras, softmax_dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(A V, stand-in)``: :func:`_attend`'s output a few query rows at a time (the softmax is
    row-wise, so each chunk's rows are those of the whole map), with a zero-stride stand-in of the
    map's shape (B, H, Q, K) instead of the map: what the recorder reads when it keeps no map.
    A scores function may carry ``fused_output(Q, K, V, *extras)``: the same output to rounding by a
    fused kernel (no map at all; the backward pass recomputes it either way), or None to decline."""
    num_queries = query.shape[-2]
    fused = getattr(scores_fn, "fused_output", None)
    output = None if fused is None else fused(query, key, value, *extras)
    if output is not None:
        return output, query.new_zeros(()).expand((*output.shape[:2], num_queries, key.shape[-2]))
    for rows, q_rows, keys, values, extras_rows, _ in row_chunks(scores_fn, query, key, value, extras):
        scores = scores_fn(q_rows, keys, *extras_rows)
        probs = attention_softmax(scores_fn, scores, softmax_dtype, in_place=True).to(query.dtype)
        part = torch.matmul(probs, values)
        if output is None:
            batch, heads, _, dim = part.shape
            output = part.new_empty(batch, num_queries, heads, dim).transpose(1, 2)
        output[..., rows, :] = part
    shape = (*output.shape[:2], num_queries, key.shape[-2])
    return output, query.new_zeros(()).expand(shape)


def _takes_rows(ctx) -> Optional[str]:
    """This pass's report (:func:`_observer_for_this_pass`) where it may run in chunks of query
    rows, else None: the observer streams the map (``takes_rows``: it folds each chunk into
    explained rows and keeps none; for a pair, the first pass defers and the second hands both
    gradients per chunk), and the scores of a row chunk are that chunk of the scores
    (``scores_fn.row_sliceable``)."""
    report = _observer_for_this_pass(ctx)
    if not getattr(ctx.scores_fn, "row_sliceable", False):
        return None
    if report is None:  # a map the stream does not read (Grad-CAM's earlier layers): chunked all the same
        return "unread" if getattr(ctx.observer, "streams_unread", False) else None
    return report if getattr(ctx.observer, "takes_rows", False) else None


def _plain_backward_in_row_chunks(ctx, plain_gradient, g_output, g_probs_outside, query, key, value, extras):
    r"""The plain backward pass a few query rows at a time: for each chunk ``c``, the scores
    ``S_c = S(Q_c, K)``, ``A_c = softmax(S_c)``, ``g_{A_c} = g_{O_c} V^T`` handed to the observer
    (:meth:`~captum_transformers.capture.recorder.SiteObserver.rows`), then
    ``g_V += A_c^T g_{O_c}``, ``g_{S_c}`` by the softmax Jacobian (row-wise) and
    ``(g_{Q_c}, g_K^{(c)}) = plain_gradient(g_{S_c}, Q_c, K)``, ``g_K = \sum_c g_K^{(c)}``.
    Equal to the whole-map backward up to the order of the sums; no (B, H, Q, K) tensor exists.

    The chunks' scores, ``g_A`` and ``g_S`` are written into three buffers made once per call
    (:class:`~.chunk_products.ChunkBuffers`), and ``g_V``, ``g_K`` accumulate in place
    (:func:`~.chunk_products.add_product`; grouped-query heads per group, ``kv_groups``):
    fresh (B, H, c, K) tensors each chunk cost a page fault per 4 KiB where freed memory goes
    back to the system (large buffers under glibc's low mmap thresholds), up to half the time."""
    if g_output is None:
        g_output = torch.zeros((*query.shape[:-1], value.shape[-1]), dtype=value.dtype, device=value.device)
    num_queries = query.shape[-2]
    hand_over = _observer_for_this_pass(ctx) is not None  # else a map no stream reads: only the gradients
    groups = kv_groups(ctx.scores_fn, plain_gradient, query, key, value, g_output)
    g_query = torch.empty_like(query) if query.requires_grad else None
    g_key = group_zeros(key, groups) if key.requires_grad else None
    g_value = group_zeros(value, groups)
    buffers = ChunkBuffers()
    writes_into = getattr(ctx.scores_fn, "writes_into", False)
    accumulates = getattr(plain_gradient, "accumulates", False)
    cut = not (hand_over and getattr(ctx.observer, "reads_masked_keys", False))
    for rows, q_rows, keys, values, extras_rows, stop in row_chunks(ctx.scores_fn, query, key, value, extras, cut):
        g_rows = g_output[..., rows, :]
        shape = (*torch.broadcast_shapes(q_rows.shape[:-2], keys.shape[:-2]), q_rows.shape[-2], stop)
        with torch.no_grad():
            scores = ctx.scores_fn(q_rows, keys, *extras_rows, out=buffers.take(0, shape, query)) if writes_into \
                else ctx.scores_fn(q_rows, keys, *extras_rows)
        soft = attention_softmax(ctx.scores_fn, scores, ctx.softmax_dtype, in_place=True)
        probs = soft.to(query.dtype)
        outside = None if g_probs_outside is None else rows_of(g_probs_outside, rows, num_queries)[..., :stop]
        g_shape = (*torch.broadcast_shapes(g_rows.shape[:-2], values.shape[:-2]), g_rows.shape[-2], stop)
        g_probs = buffers.take(1, g_shape, g_rows)
        torch.matmul(grouped(g_rows, groups), values[:, ::groups].transpose(-1, -2), out=grouped(g_probs, groups))
        if outside is not None:
            g_probs.add_(outside)
        add_product(g_value[..., :stop, :], grouped(probs, groups).transpose(-1, -2), grouped(g_rows, groups))
        if hand_over:
            ctx.observer.rows(rows, probs, g_probs, _first_pass_rows(ctx, values, rows, stop, num_queries))
        g_scores = torch.ops.aten._softmax_backward_data.out(g_probs.to(soft.dtype), soft, -1, soft.dtype,
                                                             grad_input=buffers.take(2, soft.shape, soft))
        del soft, probs, g_probs, scores
        g_scores = g_scores.to(query.dtype)
        if accumulates and g_key is not None:
            g_q, _ = plain_gradient(g_scores, q_rows, keys, key_grad=g_key[..., :stop, :])
        else:
            g_q, g_k = plain_gradient(g_scores, q_rows, keys)
            if g_key is not None:
                g_key[..., :stop, :].add_(g_k)
        if g_query is not None:
            g_query[..., rows, :] = g_q
    if hand_over:
        ctx.observer.done()
    ctx.first_pass = None
    if groups != ctx.kv_groups:  # else the per-group sums are the gradients of the heads the Function kept
        g_key = None if g_key is None else group_gradient(g_key, key, groups)
        g_value = group_gradient(g_value, value, groups).sum_to_size(value.shape)
    g_value = g_value if value.requires_grad else None
    return (None, None, None, None, None, None, g_query, g_key, g_value, *[None for _ in extras])


def _first_pass_rows(ctx, values: torch.Tensor, rows: slice, stop: int, num_queries: int) -> Optional[torch.Tensor]:
    """The deferred first pass's gradient at rows ``rows`` of the map (its first ``stop`` keys),
    recomputed from the ``g_O`` it kept (a pair, see the module docstring), or None."""
    if ctx.first_pass is None:
        return None
    first_output, first_outside = ctx.first_pass
    outside = None if first_outside is None else rows_of(first_outside, rows, num_queries)[..., :stop]
    return map_gradient(values, first_output[..., rows, :], outside, halved=halves_map_gradient(ctx))


def _plain_gradient_of_scores(ctx, plain: bool, extras) -> Optional[Callable]:
    """``scores_fn.plain_gradient`` (``(g_S, Q, K) -> (g_Q, g_K)``, which a scores function
    of the form ``S = scale Q K^T`` plus constant masks may carry) where the plain gradient is
    wanted and no extra operand (a bias, a mask) needs one: the backward then recomputes
    ``S`` without a graph and differentiates the product by hand (no scaled copy of the
    (B, H, Q, K) gradient, no autograd pass)."""
    if not plain or any(t.requires_grad for t in extras):
        return None
    return getattr(ctx.scores_fn, "plain_gradient", None)


def _observer_for_this_pass(ctx) -> Optional[str]:
    """What to do with the gradient at the map in this backward pass: nothing (``None``),
    hand it over (``"now"``), keep ``g_O`` for a later pass through the same graph
    (``"defer"``), or hand over both passes' gradients (``"pair"``)."""
    observer = ctx.observer
    if observer is None or not observer.wanted:
        return None
    if observer.deferred and ctx.switch is not None and not ctx.switch.plain:
        return "defer"
    return "pair" if ctx.first_pass is not None else "now"


def softmax_attention(scores_fn: Callable[..., torch.Tensor], query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, *extras: torch.Tensor, softmax_dtype: Optional[torch.dtype] = None,
                      observer: Optional[MapObserver] = None, keep_map: bool = True,
                      kv_groups: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""``A = softmax(scores_fn(query, key, *extras), dim=-1, dtype=softmax_dtype)`` cast to
    ``query``'s dtype, and ``O = A V``; returns ``(O, A)``.

    .. math:: O = \mathrm{softmax}(S(Q, K))\,V

    Under :func:`~captum_transformers.propagation.rules.operations.operation_rules` the backward follows
    the active rules (the softmax identity rule, the uniform product rule of Chefer et al.,
    CVPR 2021) and the backward switch; without, it is the plain gradient. Either way only
    ``query``, ``key``, ``value`` and ``extras`` (a position bias, a mask) are kept: the
    scores and the map are recomputed. ``observer`` receives ``(A, dL/dA)`` in the
    backward pass. ``extras`` must be tensors (their gradients are returned too). Without
    gradients this is just the two operations.

    ``keep_map=False`` (a caller that only reports the map through ``observer``, and a scores
    function marked ``row_sliceable``): the forward runs a few query rows at a time and returns
    a zero-stride stand-in (B, H, Q, K) for ``A``, whose gradient is not followed; no map of the
    whole sequence is made. With gradients only.

    ``kv_groups`` G > 1 (grouped-query attention): ``key`` and ``value`` have H / G heads, each
    read by G consecutive query heads (:func:`~.chunk_products.repeat_heads`); the Function keeps
    them so, and repeats them per layer in the backward pass (a 4-layer Llama with 8 heads in 2
    groups at 1k tokens: 6 MiB less at TransformerRelevance's peak, 8 % of the reference's).

    Example::

        >>> out, probs = softmax_attention(lambda q, k: q @ k.mT * 0.125, q, k, v)
    """
    tensors = (query, key, value, *extras)
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
        return _attend(scores_fn, query, repeat_heads(key, kv_groups), repeat_heads(value, kv_groups), extras,
                       softmax_dtype)
    keep_map = keep_map or not getattr(scores_fn, "row_sliceable", False)
    return _SoftmaxAttention.apply(scores_fn, softmax_dtype, ACTIVE_RULES.get(), SWITCH.get(), observer, keep_map,
                                   kv_groups, *tensors)
