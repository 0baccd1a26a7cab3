"""Softmax attention ``O = softmax(S(Q, K)) V`` as one autograd Function that keeps no map.

A captured or rule-carrying attention written as separate operations keeps, per layer, the
probabilities ``A`` (for ``A V``'s gradient) and, under the softmax identity rule, the
scores: (B, H, Q, K) tensors, where a training step's fused attention keeps only Q, K, V and
O. Here the backward recomputes ``S`` and ``A`` from Q and K (one product and one softmax
per layer), and hands ``A`` and the gradient at it to an observer (the recorder), so nothing
of size (B, H, Q, K) outlives its layer's backward.

Two backward passes through one graph (TransformerRelevance: the relevance, then the plain
gradient, see :mod:`backward_switch`) need the relevance pass's gradient at ``A`` when the
plain one arrives. Keeping it would cost a (B, H, Q, K) tensor per layer; instead the
Function keeps the gradient at its output, ``g_O`` (B, H, Q, d), and recomputes
``g_A = g_O V^T`` (halved under the uniform rule) in the second pass.
"""
from __future__ import annotations

from typing import Callable, Optional, Protocol, Tuple

import torch

from .backward_switch import _SWITCH
from .head_products import heads_matmul
from .operation_rules import _ACTIVE_RULES
from .recomputed_softmax import owns_buffer, recompute_under_rules, scores_gradient


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
    if not torch.is_grad_enabled() and scores._base is None and all(scores is not t for t in (query, key, *extras)):
        probs = _softmax_in_place(scores, softmax_dtype)
    else:
        probs = torch.softmax(scores, dim=-1, dtype=softmax_dtype)
    probs = probs.to(query.dtype)
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
        if scores.dtype == probs.dtype and softmax_dtype in (None, scores.dtype):
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
    def forward(ctx, scores_fn, softmax_dtype, mode, switch, observer, query, key, value, *extras):
        output, probs = _attend(scores_fn, query, key, value, extras, softmax_dtype)
        ctx.scores_fn, ctx.softmax_dtype, ctx.mode, ctx.switch, ctx.observer = (scores_fn, softmax_dtype, mode,
                                                                                switch, observer)
        ctx.first_pass = None
        # The product's uniform rule applies only where both operands carry relevance.
        ctx.both_operands = value.requires_grad and any(t.requires_grad for t in (query, key, *extras))
        ctx.save_for_backward(query, key, value, *extras)
        ctx.set_materialize_grads(False)
        return output, probs

    @staticmethod
    def backward(ctx, g_output, g_probs_outside):
        query, key, value, *extras = ctx.saved_tensors
        plain = ctx.mode is None or (ctx.switch is not None and ctx.switch.plain)
        rules = None if ctx.mode is None else ctx.mode.rules
        plain_gradient = _plain_gradient_of_scores(ctx, plain, extras)
        if plain_gradient is not None:
            # The scores and the map again, without a graph, the softmax in the scores' buffer.
            with torch.no_grad():
                scores = ctx.scores_fn(query, key, *extras)
            soft = _softmax_in_place(scores, ctx.softmax_dtype)
            leaves = ()
        else:
            leaves = [t.detach().requires_grad_(t.requires_grad) for t in (query, key, *extras)]
            scores = recompute_under_rules(ctx.scores_fn, leaves, None if plain else ctx.mode, ctx.switch)
            soft = torch.softmax(scores.detach(), dim=-1, dtype=ctx.softmax_dtype)
        probs = soft.to(query.dtype)
        if g_output is None:
            g_output = torch.zeros((*probs.shape[:-1], value.shape[-1]), dtype=value.dtype, device=value.device)
        report = _observer_for_this_pass(ctx)
        if report == "pair":  # the first pass's gradient at A, reduced before this pass's is made
            first_output, first_outside = ctx.first_pass
            ctx.first_pass = None
            first = _map_gradient(value, first_output, first_outside, halved=_uniform(ctx))
            ctx.observer.first(probs, first)
            del first, first_output, first_outside
        halved = not plain and _uniform(ctx)
        g_probs = _map_gradient(value, g_output, g_probs_outside, halved)
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
            return (None, None, None, None, None, g_query if query.requires_grad else None,
                    g_key if key.requires_grad else None, g_value, *[None for _ in extras])
        wanted = [leaf for leaf in leaves if leaf.requires_grad]
        grads = iter(torch.autograd.grad(scores, wanted, g_scores.to(scores.dtype), allow_unused=True)
                     if wanted else ())
        g_query, g_key, *g_extras = [next(grads) if leaf.requires_grad else None for leaf in leaves]
        g_value = g_value.sum_to_size(value.shape) if value.requires_grad else None
        return (None, None, None, None, None, g_query, g_key, g_value, *g_extras)


def _plain_gradient_of_scores(ctx, plain: bool, extras) -> Optional[Callable]:
    """``scores_fn.plain_gradient`` (``(g_S, Q, K) -> (g_Q, g_K)``, which a scores function
    of the form ``S = scale Q K^T`` plus constant masks may carry) where the plain gradient is
    wanted and no extra operand (a bias, a mask) needs one: the backward then recomputes
    ``S`` without a graph and differentiates the product by hand (no scaled copy of the
    (B, H, Q, K) gradient, no autograd pass)."""
    if not plain or any(t.requires_grad for t in extras):
        return None
    return getattr(ctx.scores_fn, "plain_gradient", None)


def _softmax_in_place(scores: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    if scores.dtype == (dtype or scores.dtype):
        return torch.softmax(scores, dim=-1, out=scores)
    return torch.softmax(scores, dim=-1, dtype=dtype)


def _uniform(ctx) -> bool:
    return ctx.mode is not None and ctx.mode.rules.matmul == "uniform" and ctx.both_operands


def _map_gradient(value, g_output, g_probs_outside, halved: bool) -> torch.Tensor:
    """The gradient at ``A`` of ``O = A V`` (halved under the uniform rule, exactly as the
    product's rule Function computes it), plus whatever reached ``A`` from outside the
    product (a model that also uses its attention weights)."""
    g_probs = torch.matmul(g_output, value.transpose(-1, -2))
    if halved:
        g_probs.mul_(0.5)
    if g_probs_outside is not None:
        g_probs.add_(g_probs_outside)
    return g_probs


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
                      observer: Optional[MapObserver] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""``A = softmax(scores_fn(query, key, *extras), dim=-1, dtype=softmax_dtype)`` cast to
    ``query``'s dtype, and ``O = A V``; returns ``(O, A)``.

    .. math:: O = \mathrm{softmax}(S(Q, K))\,V

    Under :func:`~captum_transformers.propagation.operation_rules.operation_rules` the backward follows
    the active rules (the softmax identity rule, the uniform product rule of Chefer et al.,
    CVPR 2021) and the backward switch; without, it is the plain gradient. Either way only
    ``query``, ``key``, ``value`` and ``extras`` (a position bias, a mask) are kept: the
    scores and the map are recomputed. ``observer`` receives ``(A, dL/dA)`` in the
    backward pass. ``extras`` must be tensors (their gradients are returned too). Without
    gradients this is just the two operations.

    Example::

        >>> out, probs = softmax_attention(lambda q, k: q @ k.mT * 0.125, q, k, v)
    """
    tensors = (query, key, value, *extras)
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
        return _attend(scores_fn, query, key, value, extras, softmax_dtype)
    return _SoftmaxAttention.apply(scores_fn, softmax_dtype, _ACTIVE_RULES.get(), _SWITCH.get(), observer, *tensors)
