"""Softmax attention that keeps the probabilities but not the scores for the backward pass.

The softmax identity rule of Chefer et al. (CVPR 2021) needs the softmax input; keeping it
costs one (B, H, Q, K) tensor per layer. Here the backward pass recomputes the scores from
the tensors they were made of (Q and K), under the rules that were active in the forward.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..backward_switch import SWITCH
from ..rules.normalized_add import keeps_its_sum
from ..rules.operations import ACTIVE_RULES, OperationRules, identity_ratio
from .sinks import attention_softmax


def scores_gradient(probs: torch.Tensor, scores: torch.Tensor, grad: torch.Tensor, dim: int,
                    identity: bool, owned: bool = True) -> torch.Tensor:
    """The gradient at the scores ``S`` of ``probs = softmax(S, dim, dtype=probs.dtype)``
    given the gradient ``grad`` at ``probs``: the plain softmax Jacobian, or with
    ``identity=True`` the identity rule ``g_S = (A / S) g_A`` (Chefer et al. 2021).

    The scores' values are not needed once their gradient is known (the operations that
    make them, a product, a scaling and a mask, keep no output), so the buffer of ``scores``
    (detached, owned by the caller) takes the gradient where dtypes allow: one (B, H, Q, K)
    buffer less at the peak (``owned=False``: the buffer is somebody else's, left alone).
    Returned in ``grad``'s dtype or the scores'.
    """
    same_dtype = owned and scores.dtype == probs.dtype == grad.dtype
    if not identity:
        # What autograd computes for softmax(S, dtype=...): the Jacobian in the output's
        # dtype (the caller casts back to the scores' dtype).
        g_scores = torch._softmax_backward_data(grad.to(probs.dtype), probs, dim, probs.dtype)
        return scores.copy_(g_scores) if same_dtype else g_scores
    if same_dtype:  # the identity rule, as _IdentityRule computes it, in place
        return torch.div(probs, scores, out=scores).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0).mul_(grad)
    return identity_ratio(probs, scores).to(grad.dtype).mul_(grad)


def owns_buffer(scores: torch.Tensor) -> bool:
    """Whether recomputed scores are a fresh result (may take their gradient in place), not
    one of the leaves or a view of one (``scores_fn`` may return an input as it is), nor a sum
    that the normalised add rule keeps for its own backward (``S = Q K^T + B``, a position bias)."""
    return scores.grad_fn is not None and scores._base is None and not keeps_its_sum(scores.grad_fn)


def recompute_under_rules(scores_fn: Callable[..., torch.Tensor], leaves, mode: Optional[OperationRules],
                          switch) -> torch.Tensor:
    """``scores_fn(*leaves)`` with gradients, under the rule mode and backward switch that
    were active in the forward (``mode=None``: plainly, for the plain gradient)."""
    with torch.enable_grad():
        if mode is None:
            return scores_fn(*leaves)
        token = SWITCH.set(switch)
        try:
            with OperationRules(mode.rules, mode.batch_size, mode.groups):
                return scores_fn(*leaves)
        finally:
            SWITCH.reset(token)


def _softmax(scores_fn, scores: torch.Tensor, dim: int, dtype) -> torch.Tensor:
    """The softmax over the last dimension with the sinks of ``scores_fn`` where it carries some
    (:func:`~.sinks.attention_softmax`), else ``torch.softmax(scores, dim, dtype)``."""
    if getattr(scores_fn, "sinks", None) is not None:
        if dim not in (-1, scores.dim() - 1):
            raise ValueError(f"attention sinks are a column of the last dimension, but the softmax runs over {dim}")
        return attention_softmax(scores_fn, scores, dtype)
    return torch.softmax(scores, dim=dim, dtype=dtype)


class _SoftmaxOfRecomputedScores(torch.autograd.Function):
    """``softmax(scores(*tensors))`` keeping only ``tensors`` and the probabilities: the
    backward recomputes the scores (bit-identical: the same operations on the same inputs)
    under the rules and backward switch that were active in the forward, and differentiates
    them with the softmax's gradient from the kept probabilities: the identity rule's
    ``g_S = (A / S) g_A``, or the plain softmax Jacobian when the switch says so."""

    @staticmethod
    def forward(ctx, scores_fn, dim, dtype, mode, switch, *tensors):
        probs = _softmax(scores_fn, scores_fn(*tensors), dim, dtype)
        ctx.scores_fn, ctx.dim, ctx.mode, ctx.switch = scores_fn, dim, mode, switch
        ctx.save_for_backward(probs, *tensors)
        return probs

    @staticmethod
    def backward(ctx, grad):
        probs, *tensors = ctx.saved_tensors
        plain = ctx.switch is not None and ctx.switch.plain
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
            scores = recompute_under_rules(ctx.scores_fn, leaves, None if plain else ctx.mode, ctx.switch)
            g_scores = scores_gradient(probs.detach(), scores.detach(), grad, ctx.dim,
                                       identity=not plain and ctx.mode.rules.softmax == "identity",
                                       owned=owns_buffer(scores))
            wanted = [leaf for leaf in leaves if leaf.requires_grad]
            grads = iter(torch.autograd.grad(scores, wanted, g_scores.to(scores.dtype), allow_unused=True))
        return (None, None, None, None, None, *[next(grads) if leaf.requires_grad else None for leaf in leaves])


def softmax_of_recomputed_scores(scores_fn: Callable[..., torch.Tensor], *tensors: torch.Tensor, dim: int = -1,
                                 dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``torch.softmax(scores_fn(*tensors), dim, dtype)``, keeping for the backward pass only
    ``tensors`` and the probabilities (which ``A V`` keeps anyway), not the scores.

    The softmax identity rule (Chefer et al. 2021) needs the softmax input ``S = Q K^T * scale
    (+ mask)``: one (B, H, Q, K) tensor per layer. Its backward recomputes ``S`` from ``Q`` and
    ``K`` (kept anyway by the product rule and the projections) under the same per-operation
    rules. Outside :func:`operation_rules` (or without gradients) it is just the softmax.
    Example::

        >>> probs = softmax_of_recomputed_scores(lambda q, k: q @ k.mT * scale, q, k, dim=-1)
    """
    mode = ACTIVE_RULES.get()
    if mode is None or not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
        return _softmax(scores_fn, scores_fn(*tensors), dim, dtype)
    return _SoftmaxOfRecomputedScores.apply(scores_fn, dim, dtype, mode, SWITCH.get(), *tensors)
